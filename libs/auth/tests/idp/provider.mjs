// A real OpenID Connect provider (oidc-provider 9.x) for idemgate's
// integration tests. Client-credentials grant only; access tokens are JWTs.
//
//   node provider.mjs
//
// Environment (all optional):
//   IDP_PORT          port on 127.0.0.1 (default 0: any free port)
//   IDP_ISSUER        issuer identifier (default: the URL it listens on)
//   IDP_JWKS_FILE     {"keys":[...]} of PRIVATE JWKs (RSA/EC, each with a kid)
//                     used as signing keys; default: one fresh RS256 key
//   IDP_TLS_CERT      PEM certificate (chain) } both set: serve HTTPS
//   IDP_TLS_KEY       PEM private key         }
//   IDP_JWKS_MAX_AGE  seconds; JWKS responses get Cache-Control: public, max-age=N
//   IDP_TOKEN_TTL     access token lifetime in seconds (default 600)
//
// stdout gets exactly one line, `idp listening on ISSUER`, once it serves;
// everything else (oidc-provider's notices included) goes to stderr.

import * as crypto from 'node:crypto';
import { readFileSync } from 'node:fs';
import * as http from 'node:http';
import * as https from 'node:https';

// oidc-provider prints its NOTICEs with console.info (stdout); keep stdout for
// the single "listening" line that test harnesses wait for.
console.info = console.error;
console.log = console.error;

const { default: Provider, errors } = await import('oidc-provider');

const RESOURCE = 'https://idemgate.test/payments';
const SCOPE = 'payments';
const CLIENTS = [
  { client_id: 'acme', client_secret: 'acme-secret' },
  { client_id: 'globex', client_secret: 'globex-secret' },
];
const JWKS_PATH = '/jwks';
const TOKEN_PATH = '/token';

function fail(message) {
  console.error(`idp: ${message}`);
  process.exit(2);
}

function intEnv(name, fallback, { min = 0, max = Number.MAX_SAFE_INTEGER } = {}) {
  const raw = process.env[name];
  if (raw === undefined || raw === '') return fallback;
  if (!/^\d+$/.test(raw) || Number(raw) < min || Number(raw) > max) {
    fail(`${name}=${JSON.stringify(raw)} must be an integer in ${min}..${max}`);
  }
  return Number(raw);
}

const port = intEnv('IDP_PORT', 0, { max: 65535 });
const jwksMaxAge = process.env.IDP_JWKS_MAX_AGE ? intEnv('IDP_JWKS_MAX_AGE', 0) : undefined;
const tokenTTL = intEnv('IDP_TOKEN_TTL', 600, { min: 1 });

function loadSigningKeys() {
  const file = process.env.IDP_JWKS_FILE;
  if (!file) {
    const { privateKey } = crypto.generateKeyPairSync('rsa', { modulusLength: 2048 });
    const jwk = privateKey.export({ format: 'jwk' });
    return {
      keys: [{ ...jwk, kid: `rsa-${crypto.randomBytes(4).toString('hex')}`, use: 'sig', alg: 'RS256' }],
    };
  }
  let jwks;
  try {
    jwks = JSON.parse(readFileSync(file, 'utf8'));
  } catch (err) {
    fail(`IDP_JWKS_FILE ${file}: ${err.message}`);
  }
  if (!jwks || !Array.isArray(jwks.keys) || jwks.keys.length === 0) {
    fail(`IDP_JWKS_FILE ${file}: expected {"keys":[...]} with at least one key`);
  }
  jwks.keys.forEach((k, i) => {
    if (!k || !['RSA', 'EC'].includes(k.kty)) fail(`IDP_JWKS_FILE key ${i}: kty must be RSA or EC`);
    if (typeof k.kid !== 'string' || !k.kid) fail(`IDP_JWKS_FILE key ${i}: needs a kid`);
    if (typeof k.d !== 'string') fail(`IDP_JWKS_FILE key ${i} (${k.kid}): not a private key (no "d")`);
  });
  if (!jwks.keys.some((k) => k.kty === 'RSA' && (k.alg === undefined || k.alg === 'RS256'))) {
    fail(`IDP_JWKS_FILE ${file}: access tokens are RS256, so it needs an RSA key (alg RS256 or none)`);
  }
  return { keys: jwks.keys };
}

// Minimal in-memory adapter (stops the "development-only adapter" warning;
// state is lost on restart, which is what the tests want).
function memoryAdapter() {
  const store = new Map();
  const get = (key) => {
    const hit = store.get(key);
    if (!hit) return undefined;
    if (hit.expiresAt !== undefined && hit.expiresAt <= Date.now()) {
      store.delete(key);
      return undefined;
    }
    return hit.payload;
  };
  return class MemoryAdapter {
    constructor(model) { this.model = model; }

    key(id) { return `${this.model}:${id}`; }

    async upsert(id, payload, expiresIn) {
      const expiresAt = typeof expiresIn === 'number' ? Date.now() + expiresIn * 1000 : undefined;
      store.set(this.key(id), { payload: structuredClone(payload), expiresAt });
    }

    async find(id) { return get(this.key(id)); }

    async findByUid(uid) {
      for (const key of store.keys()) {
        const p = key.startsWith(`${this.model}:`) ? get(key) : undefined;
        if (p?.uid === uid) return p;
      }
      return undefined;
    }

    async findByUserCode(userCode) {
      for (const key of store.keys()) {
        const p = key.startsWith(`${this.model}:`) ? get(key) : undefined;
        if (p?.userCode === userCode) return p;
      }
      return undefined;
    }

    async consume(id) {
      const p = get(this.key(id));
      if (p) p.consumed = Math.floor(Date.now() / 1000);
    }

    async destroy(id) { store.delete(this.key(id)); }

    async revokeByGrantId(grantId) {
      for (const [key, { payload }] of store) {
        if (payload.grantId === grantId) store.delete(key);
      }
    }
  };
}

const stats = { jwks_fetches: 0, token_requests: 0 };

function buildProvider(issuer) {
  const provider = new Provider(issuer, {
    adapter: memoryAdapter(),
    jwks: loadSigningKeys(),
    clients: CLIENTS.map((c) => ({
      ...c,
      grant_types: ['client_credentials'],
      response_types: [],
      redirect_uris: [],
      // client_secret_post is accepted too: oidc-provider treats the two
      // secret methods as interchangeable for a client registered with either.
      token_endpoint_auth_method: 'client_secret_basic',
      scope: SCOPE,
    })),
    clientAuthMethods: ['client_secret_basic', 'client_secret_post'],
    scopes: [SCOPE],
    features: {
      devInteractions: { enabled: false },
      clientCredentials: { enabled: true },
      resourceIndicators: {
        enabled: true,
        defaultResource: async () => RESOURCE,
        getResourceServerInfo: async (_ctx, resourceIndicator) => {
          if (resourceIndicator !== RESOURCE) throw new errors.InvalidTarget();
          return {
            scope: SCOPE,
            audience: RESOURCE,
            accessTokenFormat: 'jwt',
            accessTokenTTL: tokenTTL,
            jwt: { sign: { alg: 'RS256' } },
          };
        },
      },
    },
    extraTokenClaims: async (_ctx, token) => ({ tenant_id: token.clientId }),
    ttl: {
      ClientCredentials: (_ctx, token) => token.resourceServer?.accessTokenTTL ?? tokenTTL,
    },
    clientBasedCORS: () => false,
    routes: { jwks: JWKS_PATH, token: TOKEN_PATH },
  });

  // Provider is a Koa app in 9.x; provider.use() inserts before its router.
  provider.use(async (ctx, next) => {
    if (ctx.path === '/_stats') {
      ctx.set('Cache-Control', 'no-store');
      ctx.body = { ...stats };
      return;
    }
    const isJwks = ctx.path === JWKS_PATH && (ctx.method === 'GET' || ctx.method === 'HEAD');
    if (isJwks) stats.jwks_fetches += 1;
    if (ctx.path === TOKEN_PATH && ctx.method === 'POST') stats.token_requests += 1;
    await next();
    if (isJwks && jwksMaxAge !== undefined && ctx.status === 200) {
      ctx.set('Cache-Control', `public, max-age=${jwksMaxAge}`);
    }
  });

  provider.on('server_error', (_ctx, err) => console.error('idp server_error:', err));
  return provider;
}

const certFile = process.env.IDP_TLS_CERT;
const keyFile = process.env.IDP_TLS_KEY;
if (Boolean(certFile) !== Boolean(keyFile)) fail('set both IDP_TLS_CERT and IDP_TLS_KEY, or neither');
const tls = Boolean(certFile && keyFile);

let handler;
const onRequest = (req, res) => {
  if (!handler) {
    res.writeHead(503).end();
    return;
  }
  handler(req, res);
};
const server = tls
  ? https.createServer({ cert: readFileSync(certFile), key: readFileSync(keyFile) }, onRequest)
  : http.createServer(onRequest);

server.on('error', (err) => fail(`cannot listen on 127.0.0.1:${port}: ${err.message}`));
server.listen(port, '127.0.0.1', () => {
  const listening = `${tls ? 'https' : 'http'}://127.0.0.1:${server.address().port}`;
  const issuer = process.env.IDP_ISSUER || listening;
  let provider;
  try {
    provider = buildProvider(issuer);
  } catch (err) {
    fail(`bad configuration: ${err.stack || err}`);
  }
  const callback = provider.callback();
  // An issuer with a path (https://host/oidc) is served under that path.
  const mount = new URL(issuer).pathname.replace(/\/$/, '');
  handler = mount
    ? (req, res) => {
      if (req.url === mount || req.url.startsWith(`${mount}/`) || req.url.startsWith(`${mount}?`)) {
        req.originalUrl = req.url;
        req.url = req.url.slice(mount.length) || '/';
        if (req.url.startsWith('?')) req.url = `/${req.url}`;
      }
      callback(req, res);
    }
    : callback;
  process.stdout.write(`idp listening on ${issuer}\n`);
});

function shutdown() {
  server.close(() => process.exit(0));
  server.closeAllConnections();
  setTimeout(() => process.exit(0), 1000).unref();
}
process.on('SIGTERM', shutdown);
process.on('SIGINT', shutdown);
