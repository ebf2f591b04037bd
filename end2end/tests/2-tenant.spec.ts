import { test, expect } from '@playwright/test';
import { PACKAGE, ensureCatalog, hydrated, newTenant, operatorContext, signIn, watchConsole } from './helpers';

test.beforeAll(async () => {
  await ensureCatalog();
});

test('tenant: create from a package, see it run with a device, destroy it; the operator sees the device scrubbed', async ({ page, browser }) => {
  const problems = watchConsole(page);
  const t = await newTenant('tenant', 4);
  await signIn(page, t.login, t.password);
  await expect(page).toHaveURL(/\/instances$/);
  await expect(page.getByText('You have no instances yet.')).toBeVisible();

  await page.getByRole('link', { name: 'Create instance' }).first().click();
  await hydrated(page);
  const offer = page.locator(`.offer[data-package="${PACKAGE}"]`);
  await expect(offer.getByTestId('availability')).toContainText('available now');
  await page.locator('#alias').fill('train-1');
  await offer.getByRole('radio').check();
  await page.getByRole('button', { name: 'Create instance' }).click();

  // The detail page follows the job until the VM runs.
  await expect(page).toHaveURL(/\/instances\/[0-9a-f-]{36}$/);
  await expect(page.getByRole('heading', { name: 'Instance train-1' })).toBeVisible();
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  await expect(page.getByTestId('assigned-devices').locator('li')).toHaveCount(1);
  await expect(page.getByTestId('job-steps').locator('li[data-state="succeeded"]')).not.toHaveCount(0);
  const device = (await page.getByTestId('assigned-devices').locator('code').getAttribute('title')) as string;
  expect(device).toMatch(/^\/devices\//);

  // The operator sees the device used by this VM.
  const op = await operatorContext(browser);
  await op.page.goto('/admin/devices?state=used');
  await expect(op.page.locator(`tr[data-device="${device}"]`)).toBeVisible();
  const serverLink = op.page.locator(`tr[data-device="${device}"] td a`).first();
  const serverHref = (await serverLink.getAttribute('href')) as string;

  // The operator's VM list, filtered by owner and state, and the job with its steps.
  await op.page.goto(`/admin/vms?owner=${t.uuid}&state=running`);
  await expect(op.page.getByTestId('vms').locator('tbody tr')).toHaveCount(1);
  await expect(op.page.getByTestId('vms')).toContainText('train-1');
  await op.page.goto(`/admin/vms?owner=${t.uuid}&state=failed`);
  await expect(op.page.getByTestId('vms').locator('tbody tr')).toHaveCount(0);
  await op.page.goto('/admin/jobs?state=succeeded');
  const job = op.page.locator('article.job').filter({ hasText: 'provision' }).first();
  await expect(job.locator('li[data-step]')).not.toHaveCount(0);
  await expect(job.locator('li[data-step]').first()).toContainText(/\d+\.\d{3} s/);

  // Destroy, with confirmation.
  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await expect(page.getByRole('heading', { name: 'Destroy train-1?' })).toBeVisible();
  await page.getByRole('button', { name: 'Yes, destroy train-1' }).click();
  await expect(page.getByTestId('vm-state')).toHaveText('destroyed', { timeout: 60_000 });

  // The operator's server page shows the device's way back: dirty, cleaning, unassigned.
  await op.page.goto(serverHref);
  await hydrated(op.page);
  const events = op.page.getByTestId('device-events');
  for (const state of ['dirty', 'cleaning', 'unassigned']) {
    await expect(events.locator(`tr[data-device="${device}"][data-to="${state}"]`).first()).toBeVisible({ timeout: 60_000 });
  }
  await expect(op.page.locator(`[data-testid="devices"] tr[data-device="${device}"]`)).toContainText('unassigned');
  await op.ctx.close();

  expect(problems).toEqual([]);
});

test('tenant: creating without a package says to choose one; a lone fitting package is chosen already', async ({ page }) => {
  const problems = watchConsole(page);
  // With no GPU quota no package fits, so none is chosen for you.
  const none = await newTenant('nopkg', 0);
  await signIn(page, none.login, none.password);
  await page.goto('/instances/new');
  await hydrated(page);
  await expect(page.locator('input[name="package"]:checked')).toHaveCount(0);
  await page.locator('#alias').fill('no-package');
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page.locator('#package-error')).toHaveText('Choose a package.');
  await expect(page.locator('fieldset').filter({ has: page.locator('#package-error') })).toContainText(PACKAGE);
  await expect(page.getByText('Something went wrong')).toHaveCount(0);
  await expect(page).toHaveURL(/\/instances\/new$/);

  // With room for one GPU, the one-GPU package is the only one that fits: it is chosen.
  await page.context().clearCookies();
  const one = await newTenant('onepkg', 1);
  await signIn(page, one.login, one.password);
  await page.goto('/instances/new');
  const fitting = page.locator('.offer').filter({ has: page.getByTestId('availability').filter({ hasText: 'available now' }) });
  await expect(fitting).toHaveCount(1);
  await expect(fitting).toHaveAttribute('data-package', PACKAGE);
  await expect(fitting.getByRole('radio')).toBeChecked();
  await hydrated(page);
  await expect(fitting.getByRole('radio')).toBeChecked();
  await page.locator('#alias').fill('chosen-1');
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page.getByRole('heading', { name: 'Instance chosen-1' })).toBeVisible();
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await page.getByRole('button', { name: 'Yes, destroy chosen-1' }).click();
  await expect(page.getByTestId('vm-state')).toHaveText('destroyed', { timeout: 60_000 });
  expect(problems).toEqual([]);
});
