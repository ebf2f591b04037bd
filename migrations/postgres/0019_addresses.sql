-- The addresses VMs hold on networks, one row per NIC. The primary key is what keeps an
-- address from going to two VMs, and the unique MAC what keeps two NICs from sharing one.
-- A row lives from the creation that reserved it until the VM is gone from its node.
-- Kept in step with the other backend's tree.
CREATE TABLE network_ips (
    network_uuid TEXT NOT NULL REFERENCES networks (uuid),
    ip BIGINT NOT NULL,
    mac TEXT NOT NULL UNIQUE,
    vm_uuid TEXT NOT NULL,
    owner_uuid TEXT NOT NULL,
    nic_index BIGINT NOT NULL,
    created_at BIGINT NOT NULL,
    PRIMARY KEY (network_uuid, ip)
);
CREATE INDEX network_ips_vm ON network_ips (vm_uuid);

-- Where the next search for a free address starts (as NAPI does, after the last handed
-- out), so that a freed address stays out of use as long as the range allows.
ALTER TABLE networks ADD COLUMN next_ip BIGINT NOT NULL DEFAULT 0;

-- A VM's NICs as created (JSON), and its metadata for the guest (JSON object).
ALTER TABLE vms ADD COLUMN nics TEXT NOT NULL DEFAULT '[]';
ALTER TABLE vms ADD COLUMN metadata TEXT NOT NULL DEFAULT '{}';

-- The bridges a node reported (JSON array); NULL when it reports none.
ALTER TABLE servers ADD COLUMN bridges TEXT;
