//! `Debug` for messages that carry secrets (passwords, tokens, credentials): the secret
//! fields print as `<redacted>`, so a `{:?}` in a log or a panic message never shows one.

/// How a secret field prints: whether it is there, never what it is.
pub trait Redacted {
    fn redacted(&self) -> &'static str;
}

impl Redacted for String {
    fn redacted(&self) -> &'static str {
        "<redacted>"
    }
}

impl Redacted for Option<String> {
    fn redacted(&self) -> &'static str {
        match self {
            Some(_) => "Some(<redacted>)",
            None => "None",
        }
    }
}

/// `impl Debug for T` printing `shown` fields as usual and `secret` fields redacted. The
/// struct is destructured whole, so a field added later must be sorted into one list or
/// the other before this compiles.
macro_rules! debug_redacting {
    ($t:ident { $($shown:ident),* $(,)? } secret { $($secret:ident),+ $(,)? }) => {
        impl std::fmt::Debug for $t {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                use $crate::redact::Redacted;
                let $t { $($shown,)* $($secret,)+ } = self;
                f.debug_struct(stringify!($t))
                    $(.field(stringify!($shown), $shown))*
                    $(.field(stringify!($secret), &format_args!("{}", $secret.redacted())))+
                    .finish()
            }
        }
    };
}
pub(crate) use debug_redacting;

#[cfg(test)]
mod tests {
    use crate::api::{
        Account, ApiToken, CreateAccount, JoinToken, LoginRequest, LoginResponse, Role,
        UpdateAccount,
    };
    use crate::protocol::{RegisterRequest, RegisterResponse};
    use crate::{AccountId, ServerId};

    const SECRET: &str = "s3cr3t-value-9f2c";

    #[test]
    fn no_secret_reaches_debug_output() {
        let now = chrono::Utc::now();
        let account = Account {
            uuid: AccountId::new_random(),
            login: "pat".into(),
            role: Role::Tenant,
            gpu_quota: None,
            created_at: now,
        };
        let shown = [
            format!(
                "{:?}",
                CreateAccount {
                    login: "pat".into(),
                    password: SECRET.into(),
                    role: Role::Tenant,
                    gpu_quota: Some(2),
                }
            ),
            format!(
                "{:?}",
                UpdateAccount {
                    password: Some(SECRET.into()),
                    ..UpdateAccount::default()
                }
            ),
            format!(
                "{:?}",
                LoginRequest {
                    login: "pat".into(),
                    password: SECRET.into(),
                }
            ),
            format!(
                "{:?}",
                LoginResponse {
                    token: SECRET.into(),
                    expires_at: now,
                    account,
                }
            ),
            format!(
                "{:?}",
                JoinToken {
                    token: SECRET.into(),
                    expires_at: now,
                }
            ),
            format!(
                "{:?}",
                ApiToken {
                    uuid: uuid::Uuid::new_v4(),
                    name: "ci".into(),
                    expires_at: now,
                    token: Some(SECRET.into()),
                }
            ),
            format!(
                "{:?}",
                RegisterRequest {
                    join_token: SECRET.into(),
                    hostname: "cn-1".into(),
                    agent_version: "1".into(),
                    protocol_version: 1,
                }
            ),
            format!(
                "{:?}",
                RegisterResponse {
                    server_uuid: ServerId::new_random(),
                    credential: SECRET.into(),
                }
            ),
        ];
        for s in &shown {
            assert!(!s.contains(SECRET), "{s}");
            assert!(s.contains("<redacted>"), "{s}");
        }
        // The rest still shows, for debugging.
        assert!(shown[0].contains("\"pat\"") && shown[0].contains("gpu_quota: Some(2)"));
        assert!(shown[6].contains("cn-1"));
    }
}
