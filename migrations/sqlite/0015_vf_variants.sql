-- SR-IOV virtual functions as devices. A VF variant names the variant whose functions
-- make its VFs and how many each makes (written to the function's sriov_numvfs); the
-- function is then 'shared', and its VFs are reported by the node as functions of their
-- own. Kept in step with migrations/postgres.
ALTER TABLE variants ADD COLUMN num_vfs INTEGER;
