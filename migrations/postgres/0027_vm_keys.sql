-- The owner's SSH keys a VM was given at creation, as a JSON array of
-- {"name","fingerprint","key"}: what its seed trusts, whatever the account's keys become.
-- NULL for VMs made before keys could be chosen: they get the owner's keys at each start.
ALTER TABLE vms ADD COLUMN ssh_keys TEXT;
