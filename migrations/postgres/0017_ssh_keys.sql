-- Accounts' SSH public keys (after Triton's CloudAPI keys): what goes into their VMs'
-- authorized_keys, and what signs their CloudAPI requests. A name is unique per account,
-- and so is a key (by its SHA-256 fingerprint, which is how a signature names its key).
-- Kept in step with the other backend's tree.
CREATE TABLE ssh_keys (
    account_uuid TEXT NOT NULL REFERENCES accounts (uuid) ON DELETE CASCADE,
    name TEXT NOT NULL,
    public_key TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    md5_fingerprint TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (account_uuid, name),
    UNIQUE (account_uuid, fingerprint)
);
CREATE INDEX ssh_keys_md5 ON ssh_keys (account_uuid, md5_fingerprint);
