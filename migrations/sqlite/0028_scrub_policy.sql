-- How a GPU variant's devices are cleaned between tenants: 'full' (memory zeroed and
-- read back before reuse) or 'reset-only' (an operator's choice to skip the clearing).
ALTER TABLE variants ADD COLUMN scrub_policy TEXT NOT NULL DEFAULT 'full';
-- Why a device is in its state where the state alone does not say (why it was
-- quarantined; that its memory was left uncleared by the variant's policy). Written with
-- each state change that has such a reason, cleared by the next one that has none.
ALTER TABLE devices ADD COLUMN state_reason TEXT;
-- What a call changed where its method and path do not say it (a variant's scrub policy
-- set to reset-only).
ALTER TABLE audit_log ADD COLUMN detail TEXT;
