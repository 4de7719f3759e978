-- An operator's forced release of an attempt still inside its lease (docs/operations.md,
-- "Releasing a key by hand"): the row is deleted, yet that attempt may still complete, and
-- its completion then writes the record back. This mark tells the completion that the row
-- was released on purpose, by whom and why — not lost by the ledger in a failover, which
-- is what an absent row otherwise means. Kept a day, then purged with expired keys.
CREATE TABLE forced_releases (
    tenant_id   text        NOT NULL,
    attempt     uuid        NOT NULL,
    endpoint    text        NOT NULL,
    key         text        NOT NULL,
    reason      text        NOT NULL,
    released_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, attempt)
);
CREATE INDEX forced_releases_released_at_idx ON forced_releases (released_at);
