import { test, expect } from '@playwright/test';
import { ADMIN_PASSWORD, PACKAGE, api, apiToken, ensureCatalog, newTenant, removeNetwork, signIn, sshKey } from './helpers';

test.use({ javaScriptEnabled: false });

test.beforeAll(async () => {
  await ensureCatalog();
});

test('without JavaScript: sign in, create an instance, destroy it', async ({ page }) => {
  const t = await newTenant('nojs', 2);
  await page.goto('/login');
  // A wrong password comes back as an inline error, through the page's URL.
  await page.locator('#login').fill(t.login);
  await page.locator('#password').fill('wrong-password');
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expect(page.locator('#password-error')).toHaveText('Wrong login or password.');

  await page.locator('#login').fill(t.login);
  await page.locator('#password').fill(t.password);
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expect(page).toHaveURL(/\/instances$/);
  await expect(page.getByRole('button', { name: 'Sign out' })).toBeVisible();

  await page.goto('/instances/new');
  await page.locator('#alias').fill('plain-1');
  await page.locator(`.offer[data-package="${PACKAGE}"]`).getByRole('radio').check();
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page).toHaveURL(/\/instances\/[0-9a-f-]{36}$/);
  await expect(page.getByRole('heading', { name: 'Instance plain-1' })).toBeVisible();
  // No live updates without JavaScript: reload until it runs.
  await expect(async () => {
    await page.reload();
    await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 1000 });
  }).toPass({ timeout: 60_000 });

  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await page.getByRole('button', { name: 'Yes, destroy plain-1' }).click();
  await expect(async () => {
    await page.reload();
    await expect(page.getByTestId('vm-state')).toHaveText(/destroying|destroyed/, { timeout: 1000 });
  }).toPass({ timeout: 60_000 });
});

test('without JavaScript: creating without a package says to choose one, next to the packages', async ({ page }) => {
  const t = await newTenant('nojs-nopkg', 0);
  await signIn(page, t.login, t.password);
  await page.goto('/instances/new');
  await expect(page.locator('input[name="package"]:checked')).toHaveCount(0);
  await page.locator('#alias').fill('plain-none');
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page).toHaveURL(/\/instances\/new/);
  await expect(page.locator('#package-error')).toHaveText('Choose a package.');
  await expect(page.getByText('Something went wrong')).toHaveCount(0);
  await expect(page.getByText('serializ')).toHaveCount(0);
});

test('without JavaScript: a lone fitting package is chosen already', async ({ page }) => {
  const t = await newTenant('nojs-onepkg', 1);
  await signIn(page, t.login, t.password);
  await page.goto('/instances/new');
  const fitting = page.locator('.offer').filter({ has: page.getByTestId('availability').filter({ hasText: 'available now' }) });
  await expect(fitting).toHaveCount(1);
  await expect(fitting.getByRole('radio')).toBeChecked();
});

test('without JavaScript: an operator creates an image and is shown the upload as a curl command', async ({ page }) => {
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.goto('/admin/images');
  await page.locator('#i-name').fill('plain-image');
  await page.locator('#i-version').fill('1');
  await page.locator('#i-type').selectOption('raw');
  await page.getByRole('button', { name: 'Create image' }).click();
  await expect(page).toHaveURL(/\/admin\/images\/[0-9a-f-]{36}$/);
  const uuid = page.url().split('/').pop() as string;
  await expect(page.getByRole('heading', { name: 'Image plain-image@1' })).toBeVisible();
  await expect(page.getByTestId('image-state')).toHaveText('unactivated');
  // No form that could not work: the same call from a shell instead.
  await expect(page.locator('input[type="file"]')).toHaveCount(0);
  const curl = page.getByTestId('upload-curl');
  await expect(curl).toBeVisible();
  await expect(curl).toContainText(`curl -T FILE -H 'authorization: Bearer TOKEN'`);
  await expect(curl).toContainText(`/v1/images/${uuid}/file`);
  if (process.env.PASSAGE_SCREENS_DIR) {
    await page.screenshot({ path: `${process.env.PASSAGE_SCREENS_DIR}/image-nojs.png`, fullPage: true });
  }
  // Deleted again, after the page asked.
  await page.getByRole('link', { name: 'Delete image' }).click();
  await page.getByRole('button', { name: 'Yes, delete plain-image@1' }).click();
  await expect(page).toHaveURL(/\/admin\/images$/);
  await expect(page.locator('tr[data-image="plain-image"]')).toHaveCount(0);
});

test('without JavaScript: SSH keys, and an instance on a chosen network', async ({ page }) => {
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  const net = await api(admin, 'POST', '/networks', {
    name: 'e2e-tenants', subnet: '10.78.0.0/24', gateway: '10.78.0.1', bridge: 'br0', public: true,
  });
  expect([201, 409]).toContain(net.status);
  const t = await newTenant('nojs-net', 1);
  await signIn(page, t.login, t.password);

  await page.goto('/keys');
  await page.locator('#k-name').fill('bad');
  await page.locator('#k-key').fill('ssh-rsa AAAA');
  await page.getByRole('button', { name: 'Add key' }).click();
  await expect(page.locator('#key-error')).not.toBeEmpty();
  await page.locator('#k-name').fill('desk');
  await page.locator('#k-key').fill(sshKey('desk@e2e'));
  await page.getByRole('button', { name: 'Add key' }).click();
  await expect(page.locator('tr[data-key="desk"]').getByTestId('fingerprint')).toHaveText(/^SHA256:/);
  await page.getByRole('link', { name: 'Delete desk' }).click();
  await page.getByRole('button', { name: 'Yes, delete desk' }).click();
  await expect(page.locator('tr[data-key="desk"]')).toHaveCount(0);

  await page.goto('/instances/new');
  await page.locator('#alias').fill('plain-net');
  await page.locator(`.offer[data-package="${PACKAGE}"]`).getByRole('radio').check();
  await page.locator('.networks [data-network="e2e-tenants"]').getByRole('checkbox').check();
  await page.locator('#user_data').fill('#!/bin/sh\necho hello\n');
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page).toHaveURL(/\/instances\/[0-9a-f-]{36}$/);
  const nic = page.getByTestId('nics').locator('li[data-primary="true"]');
  await expect(nic).toContainText(/10\.78\.0\.\d+ on e2e-tenants/);
  const ip = (await nic.getAttribute('data-ip')) as string;
  await expect(page.getByTestId('ssh-command')).toHaveText(`ssh root@${ip}`);
  await expect(page.getByTestId('console')).toBeVisible();
  await expect(page.getByTestId('console').locator('.error')).toHaveCount(0);

  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await page.getByRole('button', { name: 'Yes, destroy plain-net' }).click();
  await expect(async () => {
    await page.reload();
    await expect(page.getByTestId('vm-state')).toHaveText(/destroying|destroyed/, { timeout: 1000 });
  }).toPass({ timeout: 60_000 });
  await removeNetwork('e2e-tenants');
});

test('without JavaScript: an operator edits a network, its owners by login', async ({ page }) => {
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  const net = await api(admin, 'POST', '/networks', { name: 'e2e-nojs-edit', subnet: '10.79.0.0/24', bridge: 'br0' });
  expect(net.status).toBe(201);
  const uuid = net.body.uuid as string;
  const t = await newTenant('nojs-owner');
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.goto(`/admin/networks/${uuid}`);
  await page.getByRole('link', { name: 'Edit network' }).click();
  await page.locator('#n-owners').fill('nobody-here-e2e');
  await page.getByRole('button', { name: 'Save network' }).click();
  await expect(page.locator('#owner_uuids-error')).toContainText('nobody-here-e2e');
  await page.locator('#n-owners').fill(t.login);
  await page.locator('#n-description').fill('edited without scripts');
  await page.getByRole('button', { name: 'Save network' }).click();
  await expect(page).toHaveURL(new RegExp(`/admin/networks/${uuid}$`));
  await expect(page.getByTestId('owners')).toHaveText(t.login);
  await expect(page.locator('.facts')).toContainText('edited without scripts');
  await removeNetwork('e2e-nojs-edit');
});
