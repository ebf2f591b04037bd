-- The firmware an image boots with (IMGAPI's `requirements.bootrom`); NULL: the VM's
-- default (UEFI with passed devices, BIOS without). Kept in step with migrations/postgres.
ALTER TABLE images ADD COLUMN bootrom TEXT CHECK (bootrom IN ('uefi', 'bios'));
