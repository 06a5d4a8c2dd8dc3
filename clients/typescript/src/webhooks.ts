// Webhook signatures: `Settle-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`.
import { createHmac, timingSafeEqual } from "node:crypto";

/** Why a delivery's signature was refused. */
export class SignatureError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "SignatureError";
  }
}

export interface VerifyOptions {
  /** How far the signature's timestamp may be from now, in seconds (default 300). */
  toleranceSeconds?: number;
  /** The receiver's clock, in unix seconds (default now). */
  now?: number;
}

type Headers = Headers_ | Record<string, string | string[] | undefined>;
type Headers_ = { get(name: string): string | null };

function header(headers: Headers, name: string): string | undefined {
  if (typeof (headers as Headers_).get === "function") return (headers as Headers_).get(name) ?? undefined;
  const h = headers as Record<string, string | string[] | undefined>;
  const key = Object.keys(h).find((k) => k.toLowerCase() === name.toLowerCase());
  const v = key === undefined ? undefined : h[key];
  return Array.isArray(v) ? v[0] : v;
}

/** The header value for `body` sent at `unixSeconds` (what Settle sends; for tests). */
export function sign(secret: string, body: string | Uint8Array, unixSeconds: number): string {
  const mac = createHmac("sha256", secret).update(`${unixSeconds}.`).update(body).digest("hex");
  return `t=${unixSeconds},v1=${mac}`;
}

/**
 * Checks a delivery's `Settle-Signature` over the exact body bytes (not a re-serialized object) and
 * its timestamp; throws `SignatureError` when it does not hold. Dedupe deliveries by the body's
 * (`epoch`, `seq`): they come at least once, in order per job, and a restored store numbers events
 * again under a new epoch.
 */
export function verifyWebhook(secret: string, headers: Headers, body: string | Uint8Array, options: VerifyOptions = {}): void {
  const value = header(headers, "settle-signature");
  if (!value) throw new SignatureError("no Settle-Signature header");
  let t: number | undefined;
  const v1: Buffer[] = [];
  for (const part of value.split(",")) {
    const [k, v] = part.split("=", 2);
    if (k === "t" && v !== undefined && /^-?\d{1,15}$/.test(v)) t = Number(v);
    if (k === "v1" && v !== undefined && /^[0-9a-f]{64}$/.test(v)) v1.push(Buffer.from(v, "hex"));
  }
  if (t === undefined || v1.length === 0) throw new SignatureError("malformed Settle-Signature header");
  const now = options.now ?? Math.floor(Date.now() / 1000);
  const tolerance = Math.abs(options.toleranceSeconds ?? 300);
  if (!Number.isFinite(now) || !Number.isFinite(tolerance)) {
    throw new SignatureError("the receiver's clock or tolerance is not a number"); // never skip the check
  }
  if (Math.abs(now - t) > tolerance) {
    throw new SignatureError("signature timestamp outside the tolerance");
  }
  const expected = createHmac("sha256", secret).update(`${t}.`).update(body).digest();
  if (!v1.some((got) => timingSafeEqual(got, expected))) throw new SignatureError("signature does not match the body");
}
