import { Page, expect, Browser, BrowserContext } from '@playwright/test';
import * as crypto from 'crypto';

export const URL = () => process.env.PASSAGE_URL as string;
export const ADMIN_PASSWORD = () => process.env.PASSAGE_ADMIN_PASSWORD as string;
export const NODES = () => Number(process.env.PASSAGE_E2E_NODES);
export const GPUS = () => Number(process.env.PASSAGE_E2E_GPUS);
export const VARIANT = 'NVIDIA_H100';
export const PACKAGE = 'gpu-1x';
/** Made by global-setup.ts: the only image, so the create page chooses it already. */
export const IMAGE = 'e2e';

/** An API token for set-up done outside the browser. */
export async function apiToken(login: string, password: string): Promise<string> {
  const r = await fetch(`${URL()}/v1/auth/login`, {
    method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ login, password }),
  });
  if (!r.ok) throw new Error(`login ${login}: ${r.status}`);
  return (await r.json()).token;
}

export async function api(token: string, method: string, path: string, body?: unknown) {
  const r = await fetch(`${URL()}/v1${path}`, {
    method,
    headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    body: body === undefined ? undefined : JSON.stringify(body),
  });
  const text = await r.text();
  return { status: r.status, body: text ? JSON.parse(text) : null };
}

/** The variant and package the tenant flows order, made through the API unless present. */
export async function ensureCatalog(): Promise<void> {
  const t = await apiToken('admin', ADMIN_PASSWORD());
  const v = await api(t, 'POST', '/variants', { name: VARIANT, type: 'gpu', vendor: '10de', device: '2330' });
  if (![201, 409].includes(v.status)) throw new Error(`variant: ${v.status} ${JSON.stringify(v.body)}`);
  const p = await api(t, 'POST', '/packages', {
    name: PACKAGE, vcpus: 8, memory_mib: 65536, disk_gib: 100, devices: { [VARIANT]: 1 },
  });
  if (![201, 409].includes(p.status)) throw new Error(`package: ${p.status} ${JSON.stringify(p.body)}`);
}

/** A tenant account with a fresh name. */
export async function newTenant(prefix: string, quota: number | null = null): Promise<{ login: string; password: string; uuid: string }> {
  const t = await apiToken('admin', ADMIN_PASSWORD());
  const login = `${prefix}-${Math.random().toString(36).slice(2, 8)}`;
  const password = `pw-${login}-secret`;
  const r = await api(t, 'POST', '/accounts', { login, password, role: 'tenant', gpu_quota: quota });
  if (r.status !== 201) throw new Error(`account: ${r.status} ${JSON.stringify(r.body)}`);
  return { login, password, uuid: r.body.uuid };
}

export async function signIn(page: Page, login: string, password: string) {
  await page.goto('/login');
  await page.locator('#login').fill(login);
  await page.locator('#password').fill(password);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expect(page.getByRole('button', { name: 'Sign out' })).toBeVisible();
}

/** Fails the test on any console error or failed request the page makes. */
export function watchConsole(page: Page): string[] {
  const problems: string[] = [];
  page.on('console', (m) => {
    // A refused form (wrong password, bad input) answers 4xx on purpose; the browser
    // logs that. Anything else is a problem.
    if (m.type() === 'error' && !/status of 4\d\d/.test(m.text())) problems.push(`console: ${m.text()}`);
  });
  page.on('pageerror', (e) => problems.push(`page error: ${e.message}`));
  return problems;
}

/** Waits until the page has hydrated (the wasm bundle ran). */
export async function hydrated(page: Page) {
  await page.locator('body[data-hydrated="true"]').waitFor({ timeout: 30_000 });
}

export async function operatorContext(browser: Browser): Promise<{ ctx: BrowserContext; page: Page }> {
  const ctx = await browser.newContext();
  const page = await ctx.newPage();
  await signIn(page, 'admin', ADMIN_PASSWORD());
  return { ctx, page };
}

/** A fresh ed25519 public key in OpenSSH's one-line form. */
export function sshKey(comment: string): string {
  const { publicKey } = crypto.generateKeyPairSync('ed25519');
  const raw = Buffer.from(publicKey.export({ format: 'jwk' }).x as string, 'base64url');
  const part = (b: Buffer) => {
    const len = Buffer.alloc(4);
    len.writeUInt32BE(b.length);
    return Buffer.concat([len, b]);
  };
  const blob = Buffer.concat([part(Buffer.from('ssh-ed25519')), part(raw)]);
  return `ssh-ed25519 ${blob.toString('base64')} ${comment}`;
}

/** Deletes the network `name` once no VM holds an address on it (a destroyed VM frees
 * its address when its destroy job ends). Left behind, a network that is not a default
 * makes every later VM that names no network fail. */
export async function removeNetwork(name: string): Promise<void> {
  const t = await apiToken('admin', ADMIN_PASSWORD());
  const nets = await api(t, 'GET', '/networks');
  const net = (nets.body as Array<{ uuid: string; name: string }>).find((n) => n.name === name);
  if (!net) return;
  await expect(async () => {
    const r = await api(t, 'DELETE', `/networks/${net.uuid}`);
    expect(r.status).toBe(204);
  }).toPass({ timeout: 60_000 });
}
