// Starts what the tests drive: the real `server` on a temporary SQLite database and two
// real `node-agent`s over fake sysfs trees (4 H100s each, `sim` hypervisor), exactly as
// an operator would run them. Addresses and the admin password go to the tests through
// environment variables; global-teardown.ts stops everything.
import { spawn, execFileSync, ChildProcess } from 'child_process';
import * as fs from 'fs';
import * as os from 'os';
import * as path from 'path';
import * as net from 'net';

/** The image every instance of the tests boots (tests/helpers.ts names it too). */
const IMAGE = 'e2e';

const NODES = 2;
const GPUS = 4;

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.listen(0, '127.0.0.1', () => {
      const addr = srv.address();
      if (addr && typeof addr === 'object') {
        const port = addr.port;
        srv.close(() => resolve(port));
      } else {
        reject(new Error('no port'));
      }
    });
  });
}

async function waitFor(what: string, ms: number, f: () => Promise<boolean>) {
  const until = Date.now() + ms;
  while (Date.now() < until) {
    try {
      if (await f()) return;
    } catch {
      // not yet
    }
    await new Promise((r) => setTimeout(r, 250));
  }
  throw new Error(`timed out waiting for ${what}`);
}

export default async function globalSetup() {
  const binDir = process.env.PASSAGE_BIN_DIR;
  if (!binDir) throw new Error('PASSAGE_BIN_DIR (the folder with `server` and `node-agent`) is not set; run `cargo xtask test`');
  const server = path.join(binDir, 'server');
  const agent = path.join(binDir, 'node-agent');
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'passage-e2e-'));
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const password = 'e2e-admin-password-' + Math.random().toString(36).slice(2);
  const pids: number[] = [];
  const start = (name: string, bin: string, args: string[], env: NodeJS.ProcessEnv = {}) => {
    const log = fs.openSync(path.join(dir, `${name}.log`), 'w');
    const child: ChildProcess = spawn(bin, args, {
      env: { ...process.env, ...env },
      stdio: ['ignore', log, log],
      detached: false,
    });
    if (child.pid) pids.push(child.pid);
    return child;
  };

  start('server', server, [
    '--listen', `127.0.0.1:${port}`,
    '--database', `sqlite://${path.join(dir, 'passage.db')}`,
    '--scrub-grace-secs', '0',
    '--heartbeat-timeout-secs', '10',
  ], { PASSAGE_ADMIN_PASSWORD: password, RUST_LOG: 'info,sqlx=warn' });
  await waitFor('the server', 30_000, async () => (await fetch(`${url}/v1/ping`)).ok);

  const login = await fetch(`${url}/v1/auth/login`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ login: 'admin', password }),
  });
  const token = (await login.json()).token as string;
  const auth = { authorization: `Bearer ${token}`, 'content-type': 'application/json' };

  // Instances boot an image: one small raw image, the only one, so the create page
  // chooses it already.
  const img = await fetch(`${url}/v1/images`, {
    method: 'POST',
    headers: auth,
    body: JSON.stringify({ name: IMAGE, version: '1', os: 'linux', type: 'raw', public: true }),
  });
  const imageUuid = (await img.json()).uuid as string;
  const up = await fetch(`${url}/v1/images/${imageUuid}/file`, {
    method: 'PUT',
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/octet-stream' },
    body: new Uint8Array(1 << 20).fill(0x5a),
  });
  if (!up.ok) throw new Error(`uploading the e2e image: ${up.status} ${await up.text()}`);

  for (let k = 1; k <= NODES; k++) {
    const node = path.join(dir, `node-${k}`);
    execFileSync(agent, ['fake-sysfs', '--out', path.join(node, 'sysfs'), '--gpus', String(GPUS), '--model', 'h100']);
    const jt = await fetch(`${url}/v1/servers/join-tokens`, { method: 'POST', headers: auth, body: '{}' });
    const join = (await jt.json()).token as string;
    start(`node-${k}`, agent, [
      'run', '--server', url, '--join-token', join,
      '--sysfs-root', path.join(node, 'sysfs'),
      '--state-dir', path.join(node, 'state'),
      '--hypervisor', 'sim', '--hostname', `e2e-node-${k}`,
    ]);
  }
  await waitFor('the nodes', 60_000, async () => {
    const r = await fetch(`${url}/v1/servers`, { headers: auth });
    const servers = (await r.json()) as Array<{ status: string }>;
    return servers.filter((s) => s.status === 'running').length === NODES;
  });

  fs.writeFileSync(path.join(__dirname, '.env.json'), JSON.stringify({ dir, pids }));
  process.env.PASSAGE_URL = url;
  process.env.PASSAGE_ADMIN_PASSWORD = password;
  process.env.PASSAGE_E2E_DIR = dir;
  process.env.PASSAGE_E2E_NODES = String(NODES);
  process.env.PASSAGE_E2E_GPUS = String(GPUS);
}
