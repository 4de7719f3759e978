-- Held keys (the reconciler's rules, docs/operations.md): an in-progress row never expires; these say since when it has
-- been waiting on the reconciler or a person, and when a probe first answered 404 (a key
-- is released only after a second 404 at least reconciler.release_confirm later).
ALTER TABLE idempotency_keys ADD COLUMN held_since timestamptz;
ALTER TABLE idempotency_keys ADD COLUMN first_not_found_at timestamptz;
