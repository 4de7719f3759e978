-- A response larger than its route's max_response_bytes is recorded without its body:
-- the operation happened once, and retries are told its result cannot be replayed.
ALTER TABLE idempotency_keys ADD COLUMN response_omitted boolean NOT NULL DEFAULT false;
