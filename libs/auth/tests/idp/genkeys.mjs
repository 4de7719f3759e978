// Writes a JWKS of PRIVATE signing keys for provider.mjs (IDP_JWKS_FILE).
//
//   node genkeys.mjs OUT.json [KID...]
//
// Each KID may be prefixed `rsa:` (RSA 2048, RS256) or `ec:` (EC P-256, ES256);
// a bare KID is EC when it starts with "ec", RSA otherwise. Without KIDs it
// writes one RSA and one EC key with random kids (rsa-XXXXXXXX, ec-XXXXXXXX).
// The provider signs access tokens with the first RSA key in the file.
// Public halves for a verifier: the provider's /jwks, or OUT.json with the
// private members (d, p, q, dp, dq, qi) dropped.

import * as crypto from 'node:crypto';
import { writeFileSync } from 'node:fs';

const [out, ...args] = process.argv.slice(2);
if (!out) {
  console.error('usage: node genkeys.mjs OUT.json [[rsa:|ec:]KID...]');
  process.exit(2);
}

const rand = () => crypto.randomBytes(4).toString('hex');
const specs = (args.length ? args : [`rsa:rsa-${rand()}`, `ec:ec-${rand()}`]).map((arg) => {
  const m = /^(rsa|ec):(.+)$/i.exec(arg);
  if (m) return { type: m[1].toLowerCase(), kid: m[2] };
  return { type: /^ec/i.test(arg) ? 'ec' : 'rsa', kid: arg };
});

const keys = specs.map(({ type, kid }) => {
  const { privateKey } = type === 'ec'
    ? crypto.generateKeyPairSync('ec', { namedCurve: 'P-256' })
    : crypto.generateKeyPairSync('rsa', { modulusLength: 2048 });
  return { kid, use: 'sig', alg: type === 'ec' ? 'ES256' : 'RS256', ...privateKey.export({ format: 'jwk' }) };
});

if (new Set(keys.map((k) => k.kid)).size !== keys.length) {
  console.error('genkeys: kids must be distinct');
  process.exit(2);
}
writeFileSync(out, `${JSON.stringify({ keys }, null, 2)}\n`, { mode: 0o600 });
console.error(`genkeys: wrote ${out}: ${keys.map((k) => `${k.kid} (${k.kty} ${k.alg})`).join(', ')}`);
