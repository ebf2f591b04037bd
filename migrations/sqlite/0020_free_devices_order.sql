-- The opening of GPUs for vGPUs reads the free-device index in (free, server) order and
-- stops after a batch's worth of servers: with the server in the index, that is a walk
-- of the first entries instead of a sort of every server's. Kept in step with the other
-- migrations tree.
DROP INDEX free_devices_by_variant;
CREATE INDEX free_devices_by_variant ON free_devices (variant, free, server_uuid);
