-- Free devices per server and variant: placement's index. Recounted from `devices` in the
-- same transaction as every change to a server's devices; a hint only (reservations stay
-- conditional on the devices themselves). Kept in step with migrations/sqlite.
CREATE TABLE free_devices (
    server_uuid TEXT NOT NULL,
    variant TEXT NOT NULL,
    free BIGINT NOT NULL,
    PRIMARY KEY (server_uuid, variant)
);
CREATE INDEX free_devices_by_variant ON free_devices (variant, free);
