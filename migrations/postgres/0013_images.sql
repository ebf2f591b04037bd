-- The image catalog (after Triton's IMGAPI). A file is stored once per SHA-256 under the
-- server's image directory; sha256 and size are NULL until an upload is checked. An
-- upload claims the row by setting uploading_since where it is NULL (a conditional write),
-- so two uploads of one image cannot run at once. Kept in step with migrations/sqlite.
CREATE TABLE images (
    uuid TEXT PRIMARY KEY NOT NULL,
    name TEXT NOT NULL,
    version TEXT NOT NULL,
    os TEXT NOT NULL,
    image_type TEXT NOT NULL,
    description TEXT,
    state TEXT NOT NULL,
    public BIGINT NOT NULL DEFAULT 0,
    owner_uuid TEXT NOT NULL REFERENCES accounts (uuid),
    published_at BIGINT,
    size BIGINT,
    sha256 TEXT,
    tags TEXT NOT NULL,
    min_disk_gib BIGINT,
    uploading_since BIGINT,
    created_at BIGINT NOT NULL,
    UNIQUE (name, version)
);
CREATE INDEX images_sha256 ON images (sha256);

-- The image a VM was built from (NULL for VMs made before images existed).
ALTER TABLE vms ADD COLUMN image_uuid TEXT;
CREATE INDEX vms_image ON vms (image_uuid);

-- A running step's progress as its agent reports it (bytes done of total).
ALTER TABLE job_steps ADD COLUMN progress_done BIGINT;
ALTER TABLE job_steps ADD COLUMN progress_total BIGINT;
