//! The node credential the control plane hands out at registration, kept in
//! `STATE/credential.json` (mode 0600: it is the node's secret).

use crate::state::{read_json, write_json};
use passage_model::ServerId;
use serde::{Deserialize, Serialize};
use std::io;
use std::path::{Path, PathBuf};

pub const CREDENTIAL_FILE: &str = "credential.json";

#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Credential {
    pub server_url: String,
    pub server_uuid: ServerId,
    pub credential: String,
}

// The secret stays out of logs and panics.
impl std::fmt::Debug for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credential")
            .field("server_url", &self.server_url)
            .field("server_uuid", &self.server_uuid)
            .field("credential", &"<redacted>")
            .finish()
    }
}

pub fn credential_path(state_dir: &Path) -> PathBuf {
    state_dir.join(CREDENTIAL_FILE)
}

pub fn load(state_dir: &Path) -> io::Result<Option<Credential>> {
    read_json(&credential_path(state_dir))
}

pub fn save(state_dir: &Path, c: &Credential) -> io::Result<()> {
    write_json(&credential_path(state_dir), c, 0o600)
}

/// Forgets the node's credential (it will join again); a missing one is already gone.
pub fn remove(state_dir: &Path) -> io::Result<()> {
    match crate::state::remove_json(&credential_path(state_dir)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_private_and_redacted() {
        let dir = tempfile::tempdir().unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        let c = Credential {
            server_url: "http://cp:8080".into(),
            server_uuid: ServerId::new_random(),
            credential: "s3cret".into(),
        };
        save(dir.path(), &c).unwrap();
        assert_eq!(load(dir.path()).unwrap(), Some(c.clone()));
        remove(dir.path()).unwrap();
        assert!(load(dir.path()).unwrap().is_none());
        remove(dir.path()).unwrap();
        save(dir.path(), &c).unwrap();
        assert!(!format!("{c:?}").contains("s3cret"));
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(credential_path(dir.path()))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }
}
