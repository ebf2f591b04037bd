-- Operator actions, audit, usage and alerts. Kept in step with migrations/sqlite.

-- A drained server takes no new placements; its running VMs are untouched.
ALTER TABLE servers ADD COLUMN disabled BIGINT NOT NULL DEFAULT 0;

CREATE TABLE audit_log (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at BIGINT NOT NULL,
    actor TEXT,
    actor_login TEXT,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    status BIGINT NOT NULL
);
CREATE INDEX audit_log_at ON audit_log (at);

-- One row per device a VM held: from attach to release.
CREATE TABLE usage_records (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    vm_uuid TEXT NOT NULL,
    owner_uuid TEXT NOT NULL,
    server_uuid TEXT NOT NULL,
    device TEXT NOT NULL,
    variant TEXT,
    started_at BIGINT NOT NULL,
    ended_at BIGINT
);
CREATE INDEX usage_records_owner ON usage_records (owner_uuid, started_at);
CREATE INDEX usage_records_vm ON usage_records (vm_uuid);

CREATE TABLE alerts (
    seq BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    variant TEXT,
    count BIGINT,
    at BIGINT NOT NULL
);
CREATE INDEX alerts_at ON alerts (at);
