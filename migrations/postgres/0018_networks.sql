-- Networks VMs take addresses from (after Triton's NAPI). Addresses are stored as text
-- (dotted quads) and as their 32-bit value for ranges and ordering. Kept in step with the
-- other backend's tree.
CREATE TABLE networks (
    uuid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    subnet TEXT NOT NULL,
    subnet_first BIGINT NOT NULL,
    subnet_last BIGINT NOT NULL,
    gateway TEXT,
    provision_start_ip TEXT NOT NULL,
    provision_end_ip TEXT NOT NULL,
    resolvers TEXT NOT NULL,
    vlan_id BIGINT NOT NULL,
    bridge TEXT NOT NULL,
    mtu BIGINT NOT NULL,
    public BIGINT NOT NULL,
    is_default BIGINT NOT NULL,
    description TEXT,
    created_at BIGINT NOT NULL
);
CREATE INDEX networks_bridge ON networks (bridge, vlan_id);

-- The tenants a non-public network is for.
CREATE TABLE network_owners (
    network_uuid TEXT NOT NULL REFERENCES networks (uuid) ON DELETE CASCADE,
    account_uuid TEXT NOT NULL REFERENCES accounts (uuid) ON DELETE CASCADE,
    PRIMARY KEY (network_uuid, account_uuid)
);
CREATE INDEX network_owners_account ON network_owners (account_uuid);

-- One row, whose lock every network write takes first: the check that a new subnet
-- overlaps none on its bridge and VLAN reads rows another writer could be adding.
CREATE TABLE network_writes (
    writes BIGINT NOT NULL
);
INSERT INTO network_writes (writes) VALUES (0);
