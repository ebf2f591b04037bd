-- Shared GPUs. A vGPU variant names its parent GPU variant, the driver's vGPU type and
-- how many of that type one GPU hosts. A GPU that hosts vGPUs is in state 'shared', and
-- each of its vGPU slots is a row of devices of its own, named by the GPU's path and a
-- UUID, with `parent` set to the GPU's id: reserved, released and scrubbed as any
-- device, never reported by a node's inventory. Kept in step with migrations/sqlite.
ALTER TABLE variants ADD COLUMN parent TEXT;
ALTER TABLE variants ADD COLUMN vgpu_type TEXT;
ALTER TABLE variants ADD COLUMN max_per_gpu BIGINT;
ALTER TABLE devices ADD COLUMN parent TEXT;
CREATE INDEX devices_parent ON devices (server_uuid, parent);
