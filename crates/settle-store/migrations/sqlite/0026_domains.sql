-- The CHECKs every write statement pays for, made cheap (issue 43 item 5; PostgreSQL's migration
-- 0026 moves its single-column CHECKs into domains for the same reason).
--
-- SQLite compiles `x IN ('a', 'b', 'c', …)` with three or more values into a temporary b-tree
-- that the statement builds, fills and throws away every time it runs — in a CHECK, on every
-- INSERT and every UPDATE of its column: a b-tree opened, a 4 KiB page zeroed, the values inserted,
-- about a fifth of the writer's instructions per transition (callgrind). Written as comparisons
-- joined by OR, the same CHECK is a few instructions. The rows refused are the same.
--
-- A CHECK's text is not part of the stored rows, so it is changed in place (SQLite's documented
-- way for changes that do not touch the stored format: the schema text edited under
-- `writable_schema`), not by copying every table. Each text is replaced only where it is exactly
-- what the earlier migrations wrote; `sqlite_and_postgres_…` and the writer's plan tests check the
-- outcome. The table made and dropped at the end moves the schema's version, so every other open
-- connection reads the new text before its next statement.
PRAGMA writable_schema = ON;

UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (state IN (''queued'', ''running'', ''unknown'', ''cancelling'', ''succeeded'', ''dead'', ''cancelled'', ''returned''))',
    'CHECK (state = ''queued'' OR state = ''running'' OR state = ''unknown'' OR state = ''cancelling'' OR state = ''succeeded'' OR state = ''dead'' OR state = ''cancelled'' OR state = ''returned'')')
WHERE type = 'table' AND name = 'jobs';

UPDATE sqlite_schema SET sql = replace(replace(sql,
    'CHECK (state IN (''charged'', ''succeeded'', ''refunded'', ''reclaimed'', ''cancelled'', ''returned''))',
    'CHECK (state = ''charged'' OR state = ''succeeded'' OR state = ''refunded'' OR state = ''reclaimed'' OR state = ''cancelled'' OR state = ''returned'')'),
    'CHECK (refund_reason IN (''job_failed'', ''item_failed'', ''cancelled''))',
    'CHECK (refund_reason = ''job_failed'' OR refund_reason = ''item_failed'' OR refund_reason = ''cancelled'')')
WHERE type = 'table' AND name = 'items';

UPDATE sqlite_schema SET sql = replace(replace(replace(sql,
    'CHECK (kind IN (''grant'', ''charge'', ''refund'', ''reclaim'', ''adjustment'', ''payout_return'',
                                                ''release'', ''expire''))',
    'CHECK (kind = ''grant'' OR kind = ''charge'' OR kind = ''refund'' OR kind = ''reclaim'' OR kind = ''adjustment''
                                                OR kind = ''payout_return'' OR kind = ''release'' OR kind = ''expire'')'),
    'CHECK ((kind IN (''grant'', ''adjustment'', ''expire'')) = (ref_id IS NOT NULL))',
    'CHECK ((kind = ''grant'' OR kind = ''adjustment'' OR kind = ''expire'') = (ref_id IS NOT NULL))'),
    'CHECK ((kind IN (''charge'', ''refund'', ''reclaim'', ''payout_return'', ''release'')) = (job_id IS NOT NULL AND item_id IS NOT NULL))',
    'CHECK ((kind = ''charge'' OR kind = ''refund'' OR kind = ''reclaim'' OR kind = ''payout_return'' OR kind = ''release'') = (job_id IS NOT NULL AND item_id IS NOT NULL))')
WHERE type = 'table' AND name = 'ledger_entries';

UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (origin IN (''grant'', ''adjustment'', ''opening''))',
    'CHECK (origin = ''grant'' OR origin = ''adjustment'' OR origin = ''opening'')')
WHERE type = 'table' AND name = 'grants';

UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (kind IN (''charge'', ''reclaim'', ''adjustment'', ''settle_debt'', ''opening''))',
    'CHECK (kind = ''charge'' OR kind = ''reclaim'' OR kind = ''adjustment'' OR kind = ''settle_debt'' OR kind = ''opening'')')
WHERE type = 'table' AND name = 'allocations';

-- Off the transitions' path, but written per event and endpoint when webhooks are on.
UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (state IN (''pending'', ''delivered'', ''dead''))',
    'CHECK (state = ''pending'' OR state = ''delivered'' OR state = ''dead'')')
WHERE type = 'table' AND name = 'webhook_deliveries';

UPDATE sqlite_schema SET sql = replace(sql,
    'CHECK (state IN (''closed'', ''open'', ''half_open''))',
    'CHECK (state = ''closed'' OR state = ''open'' OR state = ''half_open'')')
WHERE type = 'table' AND name = 'webhook_breakers';

PRAGMA writable_schema = OFF;

CREATE TABLE settle_schema_reread (x INTEGER);
DROP TABLE settle_schema_reread;
