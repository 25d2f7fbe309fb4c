//! Who leads: the role of this coordinator, as the store decides it.
//!
//! On the file store there is one coordinator and it always leads. On the
//! etcd store ([`crate::store::etcd`]) coordinators campaign for one leader
//! key; the winner leads while its etcd lease is alive. This module keeps
//! what the service needs to know of that, under one small mutex:
//!
//! * **role** and **term**: every change of role bumps the term. The store
//!   tasks win an election in term `t` ([`Leadership::begin_term`]), but the
//!   coordinator only *leads* once the service has loaded the store's state
//!   into its cluster ([`Leadership::lead`], which succeeds only while the
//!   term is still `t`). A step-down in between bumps the term, so a late
//!   `lead` for an old term changes nothing.
//! * **valid_until**: leading is trusted until the send time of the last
//!   answered etcd keep-alive plus the TTL etcd granted. etcd cannot expire
//!   the lease (and so cannot let another coordinator win) before that
//!   instant, which the server counts from when it *received* the keep-alive.
//!   A process paused past it (SIGSTOP, a long GC-like stall) finds on waking
//!   that it no longer leads before it serves anything. Every state write is
//!   also fenced in etcd itself (see the store), so even a wrong clock could
//!   not make an old leader publish.
//! * **applied_rev**: the etcd revision of the state this coordinator's
//!   cluster holds; a follower answers a read only once it has applied the
//!   revision etcd says is current.
//! * **problem**: why the store does not answer, and since when.
//! * **stepped_down**: signalled when this coordinator stops leading (or
//!   follows another), so that the service loads a state the store
//!   delivered while it led and that its own cluster does not hold (a save
//!   that committed but whose answer came too late).

// Without the etcd store only the standalone leadership is used.
#![cfg_attr(not(feature = "etcd"), allow(dead_code))]

use std::sync::Mutex;
use std::time::{Duration, Instant};

use pagewire_proto::v1::CoordinatorRole;

use crate::error::CoordError;

pub(crate) struct Leadership {
    /// This coordinator's address as clients dial it.
    me: String,
    /// The store, as `Status.store` shows it.
    store: String,
    inner: Mutex<Inner>,
    stepped_down: tokio::sync::Notify,
}

struct Inner {
    role: CoordinatorRole,
    term: u64,
    leader: Option<String>,
    /// `None`: forever (the file store).
    valid_until: Option<Instant>,
    problem: Option<(String, Instant)>,
    applied_rev: i64,
}

impl Inner {
    /// Leading, and (etcd) its session still valid at `now`.
    fn leading(&self, now: Instant) -> bool {
        self.role == CoordinatorRole::Leader && self.valid_until.is_none_or(|u| now < u)
    }
}

/// What `Status` shows of the leadership.
#[derive(Debug, Clone)]
pub(crate) struct View {
    pub(crate) role: CoordinatorRole,
    pub(crate) leader: Option<String>,
    /// Why the store does not answer, with for how long, in words.
    pub(crate) problem: Option<String>,
}

impl Leadership {
    /// The file store's coordinator: leads for ever.
    pub(crate) fn standalone(me: String, store: String) -> Self {
        Self {
            inner: Mutex::new(Inner {
                role: CoordinatorRole::Leader,
                term: 1,
                leader: Some(me.clone()),
                valid_until: None,
                problem: None,
                applied_rev: 0,
            }),
            me,
            store,
            stepped_down: tokio::sync::Notify::new(),
        }
    }

    /// A coordinator that has not won an election yet.
    pub(crate) fn candidate(me: String, store: String) -> Self {
        Self {
            inner: Mutex::new(Inner {
                role: CoordinatorRole::Candidate,
                term: 0,
                leader: None,
                valid_until: Some(Instant::now()),
                problem: None,
                applied_rev: 0,
            }),
            me,
            store,
            stepped_down: tokio::sync::Notify::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn me(&self) -> &str {
        &self.me
    }

    pub(crate) fn store(&self) -> &str {
        &self.store
    }

    /// Whether this coordinator leads now.
    pub(crate) fn is_leading(&self) -> bool {
        self.lock().leading(Instant::now())
    }

    /// Readiness (`/readyz`): `Ok` while this coordinator leads, or follows
    /// a known leader with the store answering (it then serves maps and
    /// redirects writes); otherwise why not.
    pub(crate) fn readiness(&self) -> Result<(), String> {
        let v = self.view();
        if let Some(p) = v.problem {
            return Err(format!("state store: {p}"));
        }
        match (v.role, &v.leader) {
            (CoordinatorRole::Leader, _) => Ok(()),
            (CoordinatorRole::Follower, Some(_)) => Ok(()),
            (_, Some(l)) => Err(format!("not leading; leader {l}")),
            (_, None) => Err("no leader known yet".to_owned()),
        }
    }

    /// `Ok` when this coordinator may serve a write now; otherwise the
    /// refusal that names the leader, if one is known.
    pub(crate) fn check_write(&self) -> Result<(), CoordError> {
        let i = self.lock();
        if i.leading(Instant::now()) {
            return Ok(());
        }
        let leader = i.leader.clone().filter(|l| *l != self.me);
        Err(CoordError::NotLeading {
            leader,
            problem: i.problem.as_ref().map(|(p, _)| p.clone()),
        })
    }

    /// The store tasks won an election: a new term, not leading yet.
    pub(crate) fn begin_term(&self) -> u64 {
        let mut i = self.lock();
        i.term += 1;
        i.role = CoordinatorRole::Candidate;
        i.term
    }

    /// Leads from now on, if `term` is still the current one (the state of
    /// the store is loaded: the caller holds the cluster lock).
    #[must_use]
    pub(crate) fn lead(&self, term: u64, applied_rev: i64) -> bool {
        let mut i = self.lock();
        if i.term != term {
            return false;
        }
        i.role = CoordinatorRole::Leader;
        i.leader = Some(self.me.clone());
        i.applied_rev = applied_rev;
        true
    }

    /// Stops leading (if it did) and follows `leader` (`None`: unknown).
    /// Returns whether this coordinator was leading.
    pub(crate) fn follow(&self, leader: Option<String>) -> bool {
        let was = {
            let mut i = self.lock();
            let was = i.role == CoordinatorRole::Leader;
            i.term += 1;
            i.role = if leader.is_some() {
                CoordinatorRole::Follower
            } else {
                CoordinatorRole::Candidate
            };
            i.leader = leader;
            was
        };
        // One waiter (the service's event loop); a permit is kept if it is
        // busy, so no step-down goes unnoticed.
        self.stepped_down.notify_one();
        was
    }

    /// Completes after [`Leadership::follow`] was called (at once if it was
    /// called since the last wait).
    pub(crate) async fn stepped_down(&self) {
        self.stepped_down.notified().await;
    }

    /// The etcd session is trusted until `until` (a keep-alive answered).
    pub(crate) fn extend(&self, until: Instant) {
        let mut i = self.lock();
        if i.valid_until.is_some() {
            i.valid_until = Some(until);
        }
    }

    /// The known leader, if any (never this coordinator when it does not lead).
    pub(crate) fn leader(&self) -> Option<String> {
        self.lock().leader.clone()
    }

    pub(crate) fn applied_rev(&self) -> i64 {
        self.lock().applied_rev
    }

    /// Records that the cluster now holds the state of `rev` (never goes back).
    pub(crate) fn applied(&self, rev: i64) {
        let mut i = self.lock();
        i.applied_rev = i.applied_rev.max(rev);
    }

    /// Sets or clears why the store does not answer. Returns whether this
    /// is news (a new problem, or one cleared), for logging once.
    pub(crate) fn set_problem(&self, problem: Option<String>) -> bool {
        let mut i = self.lock();
        match (&i.problem, problem) {
            (None, None) => false,
            (Some(_), None) => {
                i.problem = None;
                true
            }
            (Some((old, _)), Some(p)) if *old == p => false,
            (old, Some(p)) => {
                let since = old.as_ref().map_or_else(Instant::now, |(_, s)| *s);
                let news = old.is_none();
                i.problem = Some((p, since));
                news
            }
        }
    }

    pub(crate) fn view(&self) -> View {
        let i = self.lock();
        let leading = i.leading(Instant::now());
        View {
            role: if i.role == CoordinatorRole::Leader && !leading {
                CoordinatorRole::Candidate
            } else {
                i.role
            },
            leader: if leading {
                Some(self.me.clone())
            } else {
                i.leader.clone().filter(|l| *l != self.me)
            },
            problem: i
                .problem
                .as_ref()
                .map(|(p, since)| format!("{p} (for {})", human(since.elapsed()))),
        }
    }
}

fn human(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{} ms", d.as_millis())
    } else {
        format!("{:.1} s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_late_lead_for_an_old_term_changes_nothing() {
        let l = Leadership::candidate("me:1".into(), "etcd://x:1".into());
        assert!(l.check_write().is_err());
        let t = l.begin_term();
        l.extend(Instant::now() + Duration::from_secs(5));
        // Stepped down before the state was loaded.
        assert!(!l.follow(Some("other:2".into())));
        assert!(!l.lead(t, 7), "an old term must not lead");
        let e = l.check_write().unwrap_err();
        assert!(matches!(e, CoordError::NotLeading { leader: Some(ref x), .. } if x == "other:2"));
        let t = l.begin_term();
        assert!(l.lead(t, 9));
        assert!(l.is_leading());
        assert_eq!(l.applied_rev(), 9);
        assert_eq!(l.view().leader.as_deref(), Some("me:1"));
        // The session runs out: not leading any more, without any event.
        l.extend(Instant::now() - Duration::from_millis(1));
        assert!(!l.is_leading());
        assert!(l.check_write().is_err());
        assert_eq!(l.view().role, CoordinatorRole::Candidate);
        assert!(l.follow(None));
    }

    #[test]
    fn ready_when_leading_or_following_a_known_leader_with_the_store_answering() {
        assert_eq!(
            Leadership::standalone("me:1".into(), "file:x".into()).readiness(),
            Ok(())
        );
        let l = Leadership::candidate("me:1".into(), "etcd://x:1".into());
        assert_eq!(l.readiness(), Err("no leader known yet".to_owned()));
        let t = l.begin_term();
        l.extend(Instant::now() + Duration::from_secs(5));
        assert!(!l.follow(Some("other:2".into())));
        assert_eq!(l.readiness(), Ok(()), "a follower of a known leader serves");
        l.set_problem(Some("etcd unreachable".into()));
        assert!(l.readiness().unwrap_err().contains("etcd unreachable"));
        l.set_problem(None);
        assert!(l.lead(l.begin_term(), 3) && t > 0);
        assert_eq!(l.readiness(), Ok(()));
    }

    #[test]
    fn problems_are_news_once() {
        let l = Leadership::standalone("me:1".into(), "file:x".into());
        assert!(l.is_leading());
        assert!(l.set_problem(Some("down".into())));
        assert!(!l.set_problem(Some("down".into())));
        assert!(!l.set_problem(Some("still down".into())));
        assert!(l.view().problem.unwrap().starts_with("still down (for "));
        assert!(l.set_problem(None));
        assert!(!l.set_problem(None));
    }
}
