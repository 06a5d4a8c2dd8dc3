// Settle from TypeScript: the platform side of the HTTP API v1 (accounts, grants, jobs, cancels,
// withdrawals, ledgers, events), webhook verification, and errors carrying the API's code.
export * from "./client.js";
export * from "./errors.js";
export * from "./webhooks.js";
export { parseExact, stringifyExact } from "./json.js";
export type * from "./api-types.js";
