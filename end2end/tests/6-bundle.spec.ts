import { test, expect, Page } from '@playwright/test';
import { hydrated } from './helpers';

// What a first visit costs: every byte the sign-in page makes Chromium fetch, with an
// empty cache, until the page has hydrated. BENCHMARKS.md keeps the figures.
const BUDGET = 500_000;

type Fetched = { url: string; bytes: number; encoding: string; cacheControl: string; fromCache: boolean };

/** Records, through the DevTools protocol, what each request cost on the wire (headers
 * and body as transferred, i.e. compressed). */
async function recordTransfers(page: Page): Promise<Fetched[]> {
  const cdp = await page.context().newCDPSession(page);
  await cdp.send('Network.enable');
  const byId = new Map<string, Fetched>();
  const done: Fetched[] = [];
  cdp.on('Network.responseReceived', (e) => {
    const h = Object.fromEntries(Object.entries(e.response.headers).map(([k, v]) => [k.toLowerCase(), String(v)]));
    byId.set(e.requestId, {
      url: e.response.url,
      bytes: 0,
      encoding: h['content-encoding'] ?? '',
      cacheControl: h['cache-control'] ?? '',
      fromCache: Boolean(e.response.fromDiskCache || e.response.fromPrefetchCache || e.response.fromServiceWorker),
    });
  });
  cdp.on('Network.requestServedFromCache', (e) => {
    const f = byId.get(e.requestId);
    if (f) f.fromCache = true;
  });
  cdp.on('Network.loadingFinished', (e) => {
    const f = byId.get(e.requestId);
    if (f) {
      f.bytes = e.encodedDataLength;
      done.push(f);
    }
  });
  return done;
}

function table(fetched: Fetched[]): string {
  const path = (u: string) => new URL(u).pathname;
  const lines = fetched.map((f) => `${String(f.bytes).padStart(9)}  ${(f.encoding || '-').padEnd(4)}  ${path(f.url)}`);
  const total = fetched.reduce((n, f) => n + f.bytes, 0);
  return [...lines, `${String(total).padStart(9)}  total`].join('\n');
}

test('first load of the sign-in page stays under its budget, and a second costs only the page', async ({ page }) => {
  const fetched = await recordTransfers(page);
  await page.goto('/login');
  await hydrated(page);
  await page.waitForLoadState('networkidle');
  const total = fetched.reduce((n, f) => n + f.bytes, 0);
  console.log(`first load of /login, cold cache:\n${table(fetched)}`);
  await test.info().attach('first-load.txt', { body: table(fetched), contentType: 'text/plain' });

  expect(total, 'bytes transferred').toBeLessThanOrEqual(BUDGET);

  const bundle = fetched.filter((f) => new URL(f.url).pathname.startsWith('/pkg/'));
  // The terminal's glue (`inline0.js`, wasm-bindgen's snippet) comes with the script;
  // xterm.js itself only when a terminal is opened.
  expect(bundle.map((f) => new URL(f.url).pathname.split('/').pop()).sort()).toEqual(
    ['inline0.js', 'passage.css', 'passage.js', 'passage_bg.wasm'],
  );
  for (const f of bundle) {
    // Named by the hash of the build, so it can be kept for good.
    expect(new URL(f.url).pathname, f.url).toMatch(/^\/pkg\/[0-9a-f]{16}\//);
    expect(f.cacheControl, f.url).toBe('public, max-age=31536000, immutable');
    expect(['br', 'gzip'], f.url).toContain(f.encoding);
  }

  // The same browser again: the bundle comes from its cache, only the page is fetched.
  fetched.length = 0;
  await page.reload();
  await hydrated(page);
  await page.waitForLoadState('networkidle');
  console.log(`second load of /login:\n${table(fetched)}`);
  const refetched = fetched.filter((f) => new URL(f.url).pathname.startsWith('/pkg/') && !f.fromCache && f.bytes > 0);
  expect(refetched.map((f) => f.url)).toEqual([]);
});
