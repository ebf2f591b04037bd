-- Keyset pages of the lists: servers, VMs and jobs are read newest first with the uuid as
-- tie-breaker, `(created_at, uuid) < ($t, $u) ORDER BY created_at DESC, uuid DESC`; the
-- fleet device list follows (server hostname, server uuid, device id), the last two from
-- the devices' primary key. Kept in step with migrations/postgres.
CREATE INDEX servers_page ON servers (created_at, uuid);
CREATE INDEX servers_hostname ON servers (hostname, uuid);
CREATE INDEX vms_page ON vms (created_at, uuid);
CREATE INDEX vms_owner_page ON vms (owner_uuid, created_at, uuid);
CREATE INDEX vms_state_page ON vms (state, created_at, uuid);
-- A server's VMs (the server objects' `vms`, `?server_uuid=`, exit reconciliation).
CREATE INDEX vms_server ON vms (server_uuid, created_at);
CREATE INDEX jobs_page ON jobs (created_at, uuid);
CREATE INDEX jobs_owner_page ON jobs (owner_uuid, created_at, uuid);
-- Prefixes of the new ones.
DROP INDEX vms_created;
DROP INDEX vms_owner;
