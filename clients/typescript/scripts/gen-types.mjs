// Generates src/api-types.ts from Settle's /openapi.json: one interface per component schema.
// Usage: node scripts/gen-types.mjs <openapi.json path or http URL> [out file]
// The package's tests regenerate it from a live `settle serve` and fail when it drifted.
import { readFile, writeFile } from "node:fs/promises";

export function generate(doc) {
  const schemas = doc.components?.schemas ?? {};
  const out = [
    "// Generated from Settle's /openapi.json by scripts/gen-types.mjs: do not edit by hand.",
    "// `npm run gen-types -- http://127.0.0.1:7070/openapi.json` regenerates it.",
    "",
  ];
  for (const name of Object.keys(schemas).sort()) {
    out.push(...declaration(name, schemas[name]), "");
  }
  return out.join("\n");
}

function declaration(name, schema) {
  const doc = comment(schema.description, "");
  if (schema.allOf) {
    const parts = schema.allOf.map((s) => (s.$ref ? refName(s.$ref) : objectType(s, "")));
    return [...doc, `export type ${name} = ${parts.join(" & ")};`];
  }
  if (schema.type === "object" || schema.properties) {
    return [...doc, `export interface ${name} ${objectType(schema, "")}`];
  }
  return [...doc, `export type ${name} = ${typeOf(schema, "")};`];
}

function objectType(schema, indent) {
  const required = new Set(schema.required ?? []);
  const lines = ["{"];
  for (const key of Object.keys(schema.properties ?? {}).sort()) {
    const p = schema.properties[key];
    lines.push(...comment(p.description, indent + "  "));
    const optional = required.has(key) ? "" : "?";
    lines.push(`${indent}  ${key}${optional}: ${typeOf(p, indent + "  ")};`);
  }
  lines.push(`${indent}}`);
  return lines.join("\n");
}

function typeOf(s, indent) {
  if (s.$ref) return refName(s.$ref);
  if (s.oneOf) return s.oneOf.map((x) => typeOf(x, indent)).join(" | ");
  if (s.allOf) return s.allOf.map((x) => typeOf(x, indent)).join(" & ");
  const types = Array.isArray(s.type) ? s.type : s.type ? [s.type] : [];
  if (types.length === 0) return "unknown";
  return types.map((t) => one(t, s, indent)).join(" | ");
}

function one(t, s, indent) {
  switch (t) {
    case "integer":
    case "number":
      return "number";
    case "string":
      return "string";
    case "boolean":
      return "boolean";
    case "null":
      return "null";
    case "array":
      return `Array<${s.items ? typeOf(s.items, indent) : "unknown"}>`;
    case "object":
      return s.properties ? objectType(s, indent) : "Record<string, unknown>";
    default:
      return "unknown";
  }
}

function refName(ref) {
  return ref.split("/").pop();
}

function comment(text, indent) {
  if (!text) return [];
  const lines = String(text).replaceAll("*/", "* /").split("\n");
  return [`${indent}/**`, ...lines.map((l) => `${indent} * ${l}`.trimEnd()), `${indent} */`];
}

async function load(source) {
  if (/^https?:\/\//.test(source)) {
    const r = await fetch(source);
    if (!r.ok) throw new Error(`${source}: ${r.status}`);
    return r.json();
  }
  return JSON.parse(await readFile(source, "utf8"));
}

if (import.meta.url === `file://${process.argv[1]}`) {
  const [source, target = new URL("../src/api-types.ts", import.meta.url).pathname] = process.argv.slice(2);
  if (!source) {
    console.error("usage: node scripts/gen-types.mjs <openapi.json path or URL> [out file]");
    process.exit(2);
  }
  await writeFile(target, generate(await load(source)));
  console.log(`wrote ${target}`);
}
