// graphile-worker's own queue round trip, the yardstick of scripts/bench-http's Settle round trip
// (create -> claim -> succeed): `clients` concurrent producers call addJob for `seconds`, while one
// worker with concurrency `clients` runs a no-op task; jobs/s = jobs completed / time from the first
// add to the last completion. Run from a directory where graphile-worker is installed (bench-http
// installs 0.16 into a temp dir with npm).
//   node bench-graphile.mjs CONNECTION_STRING CLIENTS SECONDS  ->  "RESULT jobs_per_s=… added=… done=…"
// With DRAIN_JOBS (scripts/bench-sdk's yardstick), the drain alone: DRAIN_JOBS jobs are added
// first, then the worker starts; jobs/s from its start to the last completion.
//   node bench-graphile.mjs CONNECTION_STRING CLIENTS 0 DRAIN_JOBS
import { Logger, makeWorkerUtils, run } from "graphile-worker";

const quiet = new Logger(() => () => {});

const [conn, clientsArg, secondsArg, drainArg] = process.argv.slice(2);
const clients = Number(clientsArg);
const seconds = Number(secondsArg);
const drain = Number(drainArg ?? 0);
if (!conn || !(clients > 0) || !(seconds > 0 || drain > 0)) {
  console.error("usage: node bench-graphile.mjs CONNECTION_STRING CLIENTS SECONDS [DRAIN_JOBS]");
  process.exit(2);
}

const utils = await makeWorkerUtils({ connectionString: conn, maxPoolSize: clients + 2, logger: quiet });
await utils.migrate();
let done = 0;
// One worker at concurrency `clients` running a no-op task that counts.
const startRunner = () =>
  run({
    connectionString: conn,
    concurrency: clients,
    maxPoolSize: clients + 2,
    noHandleSignals: true,
    pollInterval: 1000,
    logger: quiet,
    taskList: {
      bench: async () => {
        done += 1;
      },
    },
  });
if (drain > 0) {
  let queued = 0;
  await Promise.all(
    Array.from({ length: clients }, async () => {
      while (queued < drain) {
        queued += 1;
        await utils.addJob("bench", {});
      }
    }),
  );
  const started = Date.now();
  const runner = await startRunner();
  while (done < drain && Date.now() < started + 300_000) {
    await new Promise((r) => setTimeout(r, 5));
  }
  const elapsed = (Date.now() - started) / 1000;
  await runner.stop();
  await utils.release();
  console.log(`RESULT jobs_per_s=${(done / elapsed).toFixed(1)} added=${drain} done=${done} seconds=${elapsed.toFixed(3)}`);
  process.exit(0);
}
const runner = await startRunner();

let added = 0;
const started = Date.now();
const end = started + seconds * 1000;
await Promise.all(
  Array.from({ length: clients }, async () => {
    while (Date.now() < end) {
      await utils.addJob("bench", {});
      added += 1;
    }
  }),
);
// Drain what was added (at most a minute more).
const drainBy = Date.now() + 60_000;
while (done < added && Date.now() < drainBy) {
  await new Promise((r) => setTimeout(r, 5));
}
const elapsed = (Date.now() - started) / 1000;
await runner.stop();
await utils.release();
console.log(`RESULT jobs_per_s=${(done / elapsed).toFixed(1)} added=${added} done=${done} seconds=${elapsed.toFixed(3)}`);
