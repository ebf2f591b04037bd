//! Typed identifiers: a VM uuid can never be passed where a server uuid is expected.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

macro_rules! typed_id {
    ($($(#[$doc:meta])* $name:ident),* $(,)?) => {$(
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema)]
        #[schema(value_type = String, format = Uuid)]
        #[serde(transparent)]
        pub struct $name(pub Uuid);

        impl $name {
            pub fn new_random() -> Self {
                Self(Uuid::new_v4())
            }

            /// A new id that sorts after those made before it (UUIDv7: a millisecond
            /// clock, then random bits). Rows keyed by such ids are appended to their
            /// indexes instead of being scattered over them.
            pub fn new_ordered() -> Self {
                Self(Uuid::now_v7())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                self.0.fmt(f)
            }
        }

        impl FromStr for $name {
            type Err = uuid::Error;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Uuid::parse_str(s).map(Self)
            }
        }
    )*};
}

typed_id!(
    /// A person or program with a login: operator, reader or tenant.
    AccountId,
    /// A compute node.
    ServerId,
    /// A virtual machine.
    VmId,
    /// A persisted workflow (provision, destroy).
    JobId,
    /// A package: the shape of a VM, devices included.
    PackageId,
    /// A unit of work queued for one node agent.
    TaskId,
    /// An API token.
    TokenId,
    /// An image in the catalog.
    ImageId,
    /// A network VMs take addresses from.
    NetworkId,
);

/// A name for a VM created without one, as CloudAPI makes them up: the first block of a
/// fresh uuid.
pub fn made_up_alias() -> String {
    let u = Uuid::new_v4().simple().to_string();
    u[..8].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_round_trip_and_rejects_garbage() {
        let id = VmId::new_random();
        assert_eq!(id.to_string().parse::<VmId>().unwrap(), id);
        assert!("not-a-uuid".parse::<VmId>().is_err());
        assert!("".parse::<ServerId>().is_err());
    }
}
