-- Passage schema, SQLite flavour. Kept in step with migrations/postgres (same names,
-- same columns). Times are milliseconds since the Unix epoch; uuids are text.

CREATE TABLE accounts (
    uuid TEXT PRIMARY KEY NOT NULL,
    login TEXT NOT NULL UNIQUE,
    password_hash TEXT NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('operator', 'reader', 'tenant')),
    gpu_quota INTEGER,
    -- Devices this account's VMs hold now: moved in the same transaction as the devices,
    -- so a quota check is one conditional UPDATE.
    gpu_held INTEGER NOT NULL DEFAULT 0 CHECK (gpu_held >= 0),
    created_at INTEGER NOT NULL
);

CREATE TABLE tokens (
    uuid TEXT PRIMARY KEY NOT NULL,
    account_uuid TEXT NOT NULL REFERENCES accounts (uuid) ON DELETE CASCADE,
    token_hash TEXT NOT NULL UNIQUE,
    kind TEXT NOT NULL CHECK (kind IN ('login', 'api')),
    name TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    created_at INTEGER NOT NULL
);
CREATE INDEX tokens_account ON tokens (account_uuid);

CREATE TABLE variants (
    name TEXT PRIMARY KEY NOT NULL,
    kind TEXT NOT NULL,
    vendor TEXT NOT NULL,
    device TEXT NOT NULL,
    subvendor TEXT,
    subsystem TEXT,
    revision TEXT,
    description TEXT,
    created_at INTEGER NOT NULL
);

CREATE TABLE packages (
    uuid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL UNIQUE,
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    disk_gib INTEGER NOT NULL,
    devices TEXT NOT NULL,
    created_at INTEGER NOT NULL
);

CREATE TABLE join_tokens (
    token_hash TEXT PRIMARY KEY NOT NULL,
    created_by TEXT NOT NULL,
    expires_at INTEGER NOT NULL,
    used_at INTEGER,
    server_uuid TEXT,
    created_at INTEGER NOT NULL
);

CREATE TABLE servers (
    uuid TEXT PRIMARY KEY NOT NULL,
    hostname TEXT NOT NULL,
    credential_hash TEXT NOT NULL UNIQUE,
    last_heartbeat INTEGER,
    created_at INTEGER NOT NULL
);

CREATE TABLE devices (
    server_uuid TEXT NOT NULL REFERENCES servers (uuid) ON DELETE CASCADE,
    id TEXT NOT NULL,
    bdf TEXT NOT NULL,
    vendor TEXT NOT NULL,
    device TEXT NOT NULL,
    subvendor TEXT NOT NULL,
    subsystem TEXT NOT NULL,
    revision TEXT NOT NULL,
    class TEXT NOT NULL,
    driver TEXT,
    numa_node INTEGER,
    iommu_group INTEGER,
    variant TEXT,
    state TEXT NOT NULL,
    used_by TEXT,
    generation INTEGER NOT NULL DEFAULT 0,
    missing INTEGER NOT NULL DEFAULT 0,
    taint TEXT,
    updated_at INTEGER NOT NULL,
    PRIMARY KEY (server_uuid, id)
);
CREATE INDEX devices_placement ON devices (variant, state, missing);
CREATE INDEX devices_used_by ON devices (used_by);

CREATE TABLE vms (
    uuid TEXT PRIMARY KEY NOT NULL,
    alias TEXT NOT NULL,
    owner_uuid TEXT NOT NULL REFERENCES accounts (uuid),
    server_uuid TEXT,
    package_uuid TEXT,
    state TEXT NOT NULL,
    vcpus INTEGER NOT NULL,
    memory_mib INTEGER NOT NULL,
    assigned_devices TEXT NOT NULL,
    job_uuid TEXT,
    created_at INTEGER NOT NULL,
    updated_at INTEGER NOT NULL
);
CREATE INDEX vms_owner ON vms (owner_uuid, created_at);
CREATE INDEX vms_created ON vms (created_at);

CREATE TABLE jobs (
    uuid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    vm_uuid TEXT,
    owner_uuid TEXT,
    -- Step inputs that are not the VM's (a scrub job's server and devices), as JSON.
    payload TEXT,
    state TEXT NOT NULL,
    error TEXT,
    created_at INTEGER NOT NULL,
    ended_at INTEGER
);
CREATE INDEX jobs_vm ON jobs (vm_uuid);

CREATE TABLE job_steps (
    job_uuid TEXT NOT NULL REFERENCES jobs (uuid) ON DELETE CASCADE,
    idx INTEGER NOT NULL,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    started_at INTEGER,
    ended_at INTEGER,
    error TEXT,
    PRIMARY KEY (job_uuid, idx)
);

CREATE TABLE tasks (
    uuid TEXT PRIMARY KEY NOT NULL,
    server_uuid TEXT NOT NULL,
    job_uuid TEXT,
    kind TEXT NOT NULL,
    payload TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('queued', 'taken', 'done')),
    result TEXT,
    created_at INTEGER NOT NULL,
    taken_at INTEGER,
    done_at INTEGER
);
CREATE INDEX tasks_queue ON tasks (server_uuid, state, created_at);

CREATE TABLE device_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    server_uuid TEXT NOT NULL,
    device TEXT NOT NULL,
    from_state TEXT NOT NULL,
    to_state TEXT NOT NULL,
    reason TEXT NOT NULL,
    at INTEGER NOT NULL
);
CREATE INDEX device_events_device ON device_events (server_uuid, device);

CREATE TABLE scrub_reports (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    server_uuid TEXT NOT NULL,
    device TEXT NOT NULL,
    ok INTEGER NOT NULL,
    steps TEXT NOT NULL,
    task_uuid TEXT,
    at INTEGER NOT NULL
);
CREATE INDEX scrub_reports_device ON scrub_reports (server_uuid, device);
