import { test, expect } from '@playwright/test';
import { ADMIN_PASSWORD, IMAGE, PACKAGE, api, apiToken, ensureCatalog, newTenant, signIn } from './helpers';

test.beforeAll(async () => {
  await ensureCatalog();
});

test("a tenant cannot open another tenant's instance or an operator page", async ({ page }) => {
  const owner = await newTenant('owner');
  const other = await newTenant('other');
  const token = await apiToken(owner.login, owner.password);
  const vm = await api(token, 'POST', '/vms', { alias: 'private-1', package: PACKAGE, image: IMAGE });
  expect(vm.status).toBe(202);

  await signIn(page, other.login, other.password);
  const r = await page.goto(`/instances/${vm.body.uuid}`);
  expect(r?.status()).toBe(404);
  await expect(page.getByText('Not found', { exact: true })).toBeVisible();
  await expect(page.getByText('private-1')).toHaveCount(0);

  for (const path of ['/admin', '/admin/servers', '/admin/accounts']) {
    const res = await page.goto(path);
    expect(res?.status(), path).toBe(403);
    await expect(page.getByRole('heading', { name: 'Not allowed' })).toBeVisible();
  }
  // Operator links are not even offered.
  await expect(page.getByRole('link', { name: 'Servers' })).toHaveCount(0);

  // Clean up through the API.
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  await api(admin, 'DELETE', `/vms/${vm.body.uuid}`);
});

test('signed out: pages send you to sign in, and back afterwards', async ({ page }) => {
  await page.goto('/admin/servers');
  await expect(page).toHaveURL(/\/login\?next=/);
  await page.locator('#login').fill('admin');
  await page.locator('#password').fill(ADMIN_PASSWORD());
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expect(page).toHaveURL(/\/admin\/servers$/);
});

test('state-changing posts without the CSRF token are refused', async ({ page, request }) => {
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.goto('/admin/packages');
  const action = await page.locator('form:has(#p-name)').getAttribute('action');
  const cookies = await page.context().cookies();
  const session = cookies.find((c) => c.name === 'passage_session');
  expect(session?.httpOnly).toBe(true);
  expect(session?.sameSite).toBe('Lax');
  const res = await request.post(action as string, {
    headers: { cookie: `passage_session=${session?.value}`, accept: 'application/json' },
    form: { csrf: 'forged', name: 'csrf-test', vcpus: '1', memory_mib: '1024', disk_gib: '1', 'devices[NVIDIA_H100]': '1' },
  });
  expect(res.status()).toBeGreaterThanOrEqual(400);
  await page.reload();
  await expect(page.locator('tr[data-package="csrf-test"]')).toHaveCount(0);
});
