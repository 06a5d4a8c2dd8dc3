// JSON with exact integers. Settle keeps credits as signed 64-bit integers (balances up to 2^61);
// a JavaScript number is exact only up to 2^53 − 1. Rather than round a balance silently, an answer
// holding such an integer as a credit amount is refused, and so is a request that would send one.
// Free-form JSON (a job's payload and result, an event's data) is parsed as `JSON.parse` does.

/** The fields that hold credits in Settle's answers. */
const MONEY = /"(?:amount|balance|balance_after|cost|net|overdraft_limit)"\s*:\s*$/;

/** Parses `text`, throwing a RangeError if a credit amount in it is an integer JavaScript cannot
 * hold exactly. */
export function parseExact(text: string): unknown {
  checkIntegers(text);
  return JSON.parse(text);
}

/** `JSON.stringify`, refusing numbers that are not safe integers where an integer is meant. */
export function stringifyExact(value: unknown): string {
  return JSON.stringify(value, (_key, v: unknown) => {
    if (typeof v === "number" && Number.isInteger(v) && !Number.isSafeInteger(v)) {
      throw new RangeError(`${v} is beyond 2^53 - 1: it cannot be sent exactly as a JavaScript number`);
    }
    if (typeof v === "bigint") {
      throw new RangeError("a bigint cannot be sent: credits are numbers up to 2^53 - 1 in this client");
    }
    return v;
  });
}

function checkIntegers(text: string): void {
  let i = 0;
  const n = text.length;
  while (i < n) {
    const c = text.charCodeAt(i);
    if (c === 0x22 /* " */) {
      // Skip a string literal, escapes included: ids and messages may hold digits.
      i++;
      while (i < n && text.charCodeAt(i) !== 0x22) i += text.charCodeAt(i) === 0x5c /* \ */ ? 2 : 1;
      i++;
    } else if (c === 0x2d /* - */ || (c >= 0x30 && c <= 0x39)) {
      const start = i;
      i++;
      while (i < n && /[0-9.eE+-]/.test(text[i] as string)) i++;
      const token = text.slice(start, i);
      const exact = /^-?\d+$/.test(token) ? Number.isSafeInteger(Number(token)) : true;
      if (!exact && MONEY.test(text.slice(Math.max(0, start - 40), start))) {
        throw new RangeError(`the answer holds ${token} credits, beyond what a JavaScript number holds exactly (2^53 - 1)`);
      }
    } else {
      i++;
    }
  }
}
