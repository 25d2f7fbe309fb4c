//! `pwctl policy`: shows the admission/eviction policy the coordinator
//! pushes, or changes part of it (the flags given) with `SetPolicy`. The
//! policy names are the contract's (`pagewire_proto::policy`).

use pagewire_proto::policy::{
    ADMISSION, EVICTION, admission_name, eviction_name, one_of, parse_admission, parse_eviction,
};
use pagewire_proto::v1::{
    AdmissionPolicy, EvictionPolicy, Policy, SetPolicyRequest, StatusRequest,
};
use serde_json::{Value, json};

use super::{Coord, Ctx, Usage, print_json, req};

/// The parts of the policy the flags change.
pub(crate) struct Change {
    admission: Option<AdmissionPolicy>,
    eviction: Option<EvictionPolicy>,
    high_watermark: Option<u32>,
    low_watermark: Option<u32>,
}

impl Change {
    /// The change the flags ask for, `None` when they ask for none (show
    /// the policy); a name that is no policy's is a usage error.
    pub(crate) fn parse(
        admission: Option<&str>,
        eviction: Option<&str>,
        high_watermark: Option<u32>,
        low_watermark: Option<u32>,
    ) -> Result<Option<Change>, Usage> {
        let a = admission
            .map(|a| {
                parse_admission(a).ok_or_else(|| {
                    Usage(format!(
                        "bad --admission {a:?}: expected {}",
                        one_of(ADMISSION, admission_name)
                    ))
                })
            })
            .transpose()?;
        let e = eviction
            .map(|e| {
                parse_eviction(e).ok_or_else(|| {
                    Usage(format!(
                        "bad --eviction {e:?}: expected {}",
                        one_of(EVICTION, eviction_name)
                    ))
                })
            })
            .transpose()?;
        Ok(
            (a.is_some() || e.is_some() || high_watermark.is_some() || low_watermark.is_some())
                .then_some(Change {
                    admission: a,
                    eviction: e,
                    high_watermark,
                    low_watermark,
                }),
        )
    }
}

/// `pwctl policy`: the current policy, changed first when `change` says so.
pub(crate) async fn run(c: &mut Coord, ctx: &Ctx, change: Option<Change>) -> anyhow::Result<bool> {
    let current = c
        .call("status", |mut c| async move {
            c.status(req(ctx, StatusRequest {})).await
        })
        .await?
        .policy
        .unwrap_or_default();
    let p = if let Some(change) = change {
        let mut p = current;
        if let Some(a) = change.admission {
            p.set_admission(a);
        }
        if let Some(e) = change.eviction {
            p.set_eviction(e);
        }
        if let Some(hi) = change.high_watermark {
            p.high_watermark_percent = hi;
        }
        if let Some(lo) = change.low_watermark {
            p.low_watermark_percent = lo;
        }
        let r = SetPolicyRequest { policy: Some(p) };
        c.call(
            "policy",
            |mut c| async move { c.set_policy(req(ctx, r)).await },
        )
        .await?
        .policy
        .unwrap_or_default()
    } else {
        current
    };
    if ctx.json {
        print_json(&policy_json(&p));
    } else {
        outln!("{}", policy_text(&p));
    }
    Ok(true)
}

pub(crate) fn policy_json(p: &Policy) -> Value {
    json!({
        "version": p.version,
        "admission": admission_name(p.admission()),
        "eviction": eviction_name(p.eviction()),
        "high_watermark_percent": p.high_watermark_percent,
        "low_watermark_percent": p.low_watermark_percent,
    })
}

pub(crate) fn policy_text(p: &Policy) -> String {
    format!(
        "admission {}, eviction {}, watermarks {}%/{}% (version {})",
        admission_name(p.admission()),
        eviction_name(p.eviction()),
        p.high_watermark_percent,
        p.low_watermark_percent,
        p.version
    )
}
