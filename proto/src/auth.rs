//! The cluster token: every gRPC call carries `authorization: Bearer <token>`.
//!
//! Servers wrap their services with [`TokenCheck`]; clients with
//! [`AttachToken`]. A missing or wrong token fails with `UNAUTHENTICATED` and
//! a message saying which.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// Metadata key the token travels in.
pub const AUTH_METADATA_KEY: &str = "authorization";

/// A token that cannot be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TokenError {
    #[error("the cluster token is empty")]
    Empty,
    #[error("the cluster token is longer than {max} bytes")]
    TooLong { max: usize },
    #[error("the cluster token must be printable ASCII without spaces")]
    NotPrintable,
}

const MAX_TOKEN_LEN: usize = 4096;

/// Checks that `token` can travel as gRPC metadata.
pub fn validate_token(token: &str) -> Result<(), TokenError> {
    if token.is_empty() {
        return Err(TokenError::Empty);
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(TokenError::TooLong { max: MAX_TOKEN_LEN });
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(TokenError::NotPrintable);
    }
    Ok(())
}

/// Server side: refuses calls without the cluster token, and counts them.
#[derive(Clone)]
pub struct TokenCheck {
    expected: Arc<[u8]>,
    refused: Arc<Refusals>,
}

/// Calls a [`TokenCheck`] (and its clones) refused, by reason: for the
/// server's metrics (a client with a stale or foreign token shows up there,
/// not only in its own logs).
#[derive(Debug, Default)]
pub struct Refusals {
    /// No `authorization` metadata.
    pub missing: AtomicU64,
    /// `authorization` without the `Bearer ` scheme.
    pub malformed: AtomicU64,
    /// A token that is not this cluster's.
    pub wrong: AtomicU64,
}

impl Refusals {
    /// `(reason, count)` for each reason, as metrics label them.
    pub fn by_reason(&self) -> [(&'static str, u64); 3] {
        [
            ("missing", self.missing.load(Ordering::Relaxed)),
            ("malformed", self.malformed.load(Ordering::Relaxed)),
            ("wrong", self.wrong.load(Ordering::Relaxed)),
        ]
    }

    /// These counters as `grpc_unauthenticated_total{reason}` (under the
    /// registry's prefix and labels), read on each scrape: the one encoding
    /// the node and the coordinator both register.
    #[cfg(feature = "server")]
    pub fn collector(self: Arc<Self>) -> Box<dyn prometheus_client::collector::Collector> {
        Box::new(RefusalCollector(self))
    }
}

#[cfg(feature = "server")]
#[derive(Debug)]
struct RefusalCollector(Arc<Refusals>);

#[cfg(feature = "server")]
impl prometheus_client::collector::Collector for RefusalCollector {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder<'_>,
    ) -> std::fmt::Result {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        let mut m = enc.encode_descriptor(
            "grpc_unauthenticated",
            "gRPC calls refused for their cluster token (reason: missing, malformed, wrong)",
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for (reason, v) in self.0.by_reason() {
            ConstCounter::new(v).encode(m.encode_family(&[("reason", reason)])?)?;
        }
        Ok(())
    }
}

impl TokenCheck {
    pub fn new(token: &str) -> Result<Self, TokenError> {
        validate_token(token)?;
        Ok(Self {
            expected: Arc::from(format!("Bearer {token}").into_bytes()),
            refused: Arc::default(),
        })
    }

    /// As [`TokenCheck::new`], counting refusals into `refused` (a
    /// server's metrics, created before the check).
    pub fn counting_into(token: &str, refused: Arc<Refusals>) -> Result<Self, TokenError> {
        Ok(Self {
            refused,
            ..Self::new(token)?
        })
    }

    /// The refusals of this check and its clones.
    pub fn refusals(&self) -> Arc<Refusals> {
        self.refused.clone()
    }

    fn refuse(&self, count: &AtomicU64, message: &'static str) -> Status {
        // Relaxed: a statistic.
        count.fetch_add(1, Ordering::Relaxed);
        Status::unauthenticated(message)
    }
}

impl std::fmt::Debug for TokenCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCheck { .. }")
    }
}

/// Compares without an early exit, so the time taken says nothing about how
/// much of the token matched.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Interceptor for TokenCheck {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let r = &self.refused;
        match request.metadata().get(AUTH_METADATA_KEY) {
            None => Err(self.refuse(
                &r.missing,
                "missing cluster token: send metadata `authorization: Bearer <token>`",
            )),
            Some(value) if constant_time_eq(value.as_bytes(), &self.expected) => Ok(request),
            // The scheme is no secret: say what form is expected.
            Some(value) if !value.as_bytes().starts_with(b"Bearer ") => Err(self.refuse(
                &r.malformed,
                "malformed cluster token: send metadata `authorization: Bearer <token>` \
                 (the word Bearer, one space, then the token)",
            )),
            Some(_) => Err(self.refuse(
                &r.wrong,
                "wrong cluster token: `authorization: Bearer <token>` did not match this \
                 cluster's token",
            )),
        }
    }
}

/// Client side: adds the cluster token to every call.
#[derive(Clone)]
pub struct AttachToken {
    value: MetadataValue<Ascii>,
}

impl AttachToken {
    pub fn new(token: &str) -> Result<Self, TokenError> {
        validate_token(token)?;
        let value = format!("Bearer {token}")
            .parse()
            .map_err(|_| TokenError::NotPrintable)?;
        Ok(Self { value })
    }
}

impl std::fmt::Debug for AttachToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AttachToken { .. }")
    }
}

impl Interceptor for AttachToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request
            .metadata_mut()
            .insert(AUTH_METADATA_KEY, self.value.clone());
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_round_trip() {
        let mut attach = AttachToken::new("s3cret").unwrap();
        let mut check = TokenCheck::new("s3cret").unwrap();
        let req = attach.call(Request::new(())).unwrap();
        assert!(check.call(req).is_ok());
    }

    #[test]
    fn wrong_and_missing_tokens_are_unauthenticated() {
        let mut check = TokenCheck::new("s3cret").unwrap();
        let err = check.call(Request::new(())).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(err.message().contains("missing"));
        let req = AttachToken::new("other")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        let err = check.call(req).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(err.message().contains("wrong"));
        // The right token without the scheme: say which form is expected.
        let mut bare = Request::new(());
        bare.metadata_mut()
            .insert(AUTH_METADATA_KEY, "s3cret".parse().unwrap());
        let err = check.call(bare).unwrap_err();
        assert_eq!(err.code(), tonic::Code::Unauthenticated);
        assert!(
            err.message().contains("malformed") && err.message().contains("Bearer <token>"),
            "{}",
            err.message()
        );
        // One of each, counted by the check and its clones alike.
        let mut clone = check.clone();
        let req = AttachToken::new("third")
            .unwrap()
            .call(Request::new(()))
            .unwrap();
        assert!(clone.call(req).is_err());
        assert_eq!(
            check.refusals().by_reason(),
            [("missing", 1), ("malformed", 1), ("wrong", 2)]
        );
    }

    #[test]
    fn bad_tokens_are_refused() {
        assert!(matches!(validate_token(""), Err(TokenError::Empty)));
        assert!(matches!(
            validate_token("a b"),
            Err(TokenError::NotPrintable)
        ));
        assert!(matches!(
            validate_token(&"x".repeat(5000)),
            Err(TokenError::TooLong { .. })
        ));
    }
}
