-- The hot tables, second change (issue 43 item 3, docs/design/hot-tables.md): single-column CHECKs
-- become domains.
--
-- PostgreSQL re-reads a table's CHECK constraints from their stored text (`stringToNode`) and plans
-- them again in every statement that writes the table, and checks every one of them on every
-- write: about 6 % of the server's CPU per transition in the profile. A domain's constraints are
-- planned once per backend (the type cache) and checked only on the columns a statement assigns.
-- The rows refused are the same: each domain's CHECK is the column's old one, word for word.
--
-- Done without rewriting or reading a big table: each column first takes a domain without
-- constraints (binary compatible, so PostgreSQL keeps the heap and, but for the small partial
-- `grants_burn`, the indexes), then the domain takes its CHECK as NOT VALID: enforced on every row
-- written from now on, not checked again on the rows already stored — each of which was written
-- under the same CHECK as a table constraint, so reading them all again would prove nothing and
-- hold an upgrade for the time it takes to read the ledger.
--
-- Stay table constraints: the multi-column CHECKs (a domain sees one value), and the ledger's
-- `kind` (its column is a key of the partial `ledger_entries_ref`, which a change of type rebuilds
-- by reading the whole ledger: migration 0019 added that CHECK NOT VALID to spare upgrades that).

CREATE DOMAIN credits AS bigint;
CREATE DOMAIN positive_count AS bigint;
CREATE DOMAIN position_from_zero AS bigint;
CREATE DOMAIN position_from_one AS bigint;
CREATE DOMAIN flag AS bigint;
CREATE DOMAIN grant_priority AS bigint;
CREATE DOMAIN job_state AS text;
CREATE DOMAIN refund_on AS text;
CREATE DOMAIN item_state AS text;
CREATE DOMAIN refund_reason AS text;
CREATE DOMAIN grant_origin AS text;
CREATE DOMAIN allocation_kind AS text;

ALTER TABLE jobs
    DROP CONSTRAINT jobs_state_check,
    DROP CONSTRAINT jobs_refund_on_check,
    DROP CONSTRAINT jobs_cancel_requested_check,
    DROP CONSTRAINT jobs_cost_check,
    DROP CONSTRAINT jobs_max_attempts_check,
    ALTER COLUMN state TYPE job_state,
    ALTER COLUMN refund_on TYPE refund_on,
    ALTER COLUMN cancel_requested TYPE flag,
    ALTER COLUMN cost TYPE credits,
    ALTER COLUMN max_attempts TYPE positive_count;

ALTER TABLE items
    DROP CONSTRAINT items_state_check,
    DROP CONSTRAINT items_refund_reason_check,
    DROP CONSTRAINT items_cost_check,
    ALTER COLUMN state TYPE item_state,
    ALTER COLUMN refund_reason TYPE refund_reason,
    ALTER COLUMN cost TYPE credits;

ALTER TABLE accounts
    DROP CONSTRAINT accounts_debt_check,
    DROP CONSTRAINT accounts_entries_check,
    DROP CONSTRAINT accounts_exposure_check,
    DROP CONSTRAINT accounts_held_check,
    DROP CONSTRAINT accounts_overdraft_limit_check,
    ALTER COLUMN debt TYPE credits,
    ALTER COLUMN last_account_seq TYPE position_from_zero,
    ALTER COLUMN exposure TYPE credits,
    ALTER COLUMN held TYPE credits,
    ALTER COLUMN overdraft_limit TYPE credits;

ALTER TABLE ledger_entries
    DROP CONSTRAINT ledger_entries_account_seq_check,
    ALTER COLUMN account_seq TYPE position_from_one;

ALTER TABLE grants
    DROP CONSTRAINT grants_origin_check,
    DROP CONSTRAINT grants_amount_check,
    DROP CONSTRAINT grants_remaining_check,
    DROP CONSTRAINT grants_priority_check,
    ALTER COLUMN origin TYPE grant_origin,
    ALTER COLUMN amount TYPE credits,
    ALTER COLUMN remaining TYPE credits,
    ALTER COLUMN priority TYPE grant_priority;

ALTER TABLE allocations
    DROP CONSTRAINT allocations_kind_check,
    DROP CONSTRAINT allocations_account_seq_check,
    DROP CONSTRAINT allocations_taken_check,
    DROP CONSTRAINT allocations_given_back_check,
    DROP CONSTRAINT allocations_settled_check,
    ALTER COLUMN kind TYPE allocation_kind,
    ALTER COLUMN account_seq TYPE position_from_zero,
    ALTER COLUMN taken TYPE positive_count,
    ALTER COLUMN given_back TYPE credits,
    ALTER COLUMN settled TYPE credits;

ALTER DOMAIN credits ADD CONSTRAINT credits_check CHECK (VALUE >= 0) NOT VALID;
ALTER DOMAIN positive_count ADD CONSTRAINT positive_count_check CHECK (VALUE >= 1) NOT VALID;
ALTER DOMAIN position_from_zero ADD CONSTRAINT position_from_zero_check CHECK (VALUE >= 0) NOT VALID;
ALTER DOMAIN position_from_one ADD CONSTRAINT position_from_one_check CHECK (VALUE >= 1) NOT VALID;
ALTER DOMAIN flag ADD CONSTRAINT flag_check CHECK (VALUE IN (0, 1)) NOT VALID;
ALTER DOMAIN grant_priority ADD CONSTRAINT grant_priority_check CHECK (VALUE >= 0 AND VALUE <= 100) NOT VALID;
ALTER DOMAIN job_state ADD CONSTRAINT job_state_check
    CHECK (VALUE IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled', 'returned')) NOT VALID;
ALTER DOMAIN refund_on ADD CONSTRAINT refund_on_check CHECK (VALUE IN ('failure', 'final_failure')) NOT VALID;
ALTER DOMAIN item_state ADD CONSTRAINT item_state_check
    CHECK (VALUE IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled', 'returned')) NOT VALID;
ALTER DOMAIN refund_reason ADD CONSTRAINT refund_reason_check CHECK (VALUE IN ('job_failed', 'item_failed', 'cancelled')) NOT VALID;
ALTER DOMAIN grant_origin ADD CONSTRAINT grant_origin_check CHECK (VALUE IN ('grant', 'adjustment', 'opening')) NOT VALID;
ALTER DOMAIN allocation_kind ADD CONSTRAINT allocation_kind_check
    CHECK (VALUE IN ('charge', 'reclaim', 'adjustment', 'settle_debt', 'opening')) NOT VALID;
