-- Console sign-outs (issue 41, decision 0028): the nonce of every session signed out, until it would
-- have expired (unix seconds). Kept in the store, not in one process's memory, so a signed-out
-- cookie stays signed out after a restart and in every process that shares SETTLE_CONSOLE_SECRET.
CREATE TABLE console_signouts (
    nonce      TEXT PRIMARY KEY,
    expires_at INTEGER NOT NULL
) STRICT;
