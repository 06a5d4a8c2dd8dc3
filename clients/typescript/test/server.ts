// A real `settle serve` for the tests: on a free port, over SQLite in a temp dir or the PostgreSQL
// database `SETTLE_TS_TESTS_DB` names, with tokens and a webhook endpoint, stopped at the end.
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, writeFileSync, existsSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";

export const ADMIN = "ts-tests-admin-token-0123";
export const CLIENT = "ts-tests-client-token-0123";
export const HOOK_SECRET = "ts-tests-webhook-secret-0123";

export interface Served {
  base: string;
  stop(): Promise<void>;
}

async function freePort(): Promise<number> {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => {
      const port = (s.address() as { port: number }).port;
      s.close(() => ok(port));
    });
  });
}

export async function serve(hookUrl: string): Promise<Served> {
  const root = resolve(import.meta.dirname, "..", "..", "..", "..");
  const binary = process.env.SETTLE_BIN ?? join(root, "target", "debug", "settle");
  if (!existsSync(binary)) throw new Error(`${binary} is missing: build it first (cargo build)`);
  const dir = mkdtempSync(join(tmpdir(), "settle-ts-tests-"));
  const config = join(dir, "settle.toml");
  writeFileSync(
    config,
    `[loops]\nrescue_every_ms = 200\nsweep_every_ms = 200\n\n[[webhooks]]\nid = "ts"\nurl = "${hookUrl}"\nsecret = "${HOOK_SECRET}"\nstart_from = "beginning"\n`,
  );
  // The funding provider simulator: top-ups are charged through it (customers `declined…` are declined).
  const fundingPort = await freePort();
  const funding: ChildProcess = spawn(binary, ["funding-sim", "--listen", `127.0.0.1:${fundingPort}`], {
    cwd: dir,
    stdio: ["ignore", "ignore", "inherit"],
  });
  for (let i = 0; ; i++) {
    try {
      if ((await fetch(`http://127.0.0.1:${fundingPort}/v1/executed`)).ok) break;
    } catch {
      // not listening yet
    }
    if (funding.exitCode !== null || i > 400) throw new Error("settle funding-sim did not start");
    await new Promise((r) => setTimeout(r, 50));
  }
  const port = await freePort();
  const env = {
    SETTLE_FUNDING_URL: `http://127.0.0.1:${fundingPort}`,
    ...process.env,
    SETTLE_LOG: process.env.SETTLE_LOG ?? "warn",
    SETTLE_TOKENS: `admin:ts-admin=${ADMIN},client:ts-client=${CLIENT}`,
    SETTLE_DATABASE_URL: process.env.SETTLE_TS_TESTS_DB ?? `sqlite://${join(dir, "settle.db")}`,
  };
  const child: ChildProcess = spawn(binary, ["serve", "--listen", `127.0.0.1:${port}`, "--config", config], {
    cwd: dir,
    env,
    stdio: ["ignore", "ignore", "inherit"],
  });
  const base = `http://127.0.0.1:${port}`;
  for (let i = 0; ; i++) {
    try {
      if ((await fetch(`${base}/healthz`)).ok) break;
    } catch {
      // not listening yet
    }
    if (child.exitCode !== null || i > 400) throw new Error("settle serve did not start");
    await new Promise((r) => setTimeout(r, 50));
  }
  return {
    base,
    stop: () =>
      new Promise<void>((ok) => {
        child.once("exit", () => {
          funding.kill("SIGTERM");
          ok();
        });
        child.kill("SIGTERM");
      }),
  };
}
