import { test, expect } from '@playwright/test';
import { ADMIN_PASSWORD, PACKAGE, api, apiToken, ensureCatalog, hydrated, newTenant, operatorContext, removeNetwork, signIn, sshKey, watchConsole } from './helpers';

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

  // The image it boots, and the power buttons, each offered as the state allows.
  await expect(page.getByTestId('vm-image')).toHaveText(/^e2e@/);
  const power = page.getByTestId('power');
  await expect(power.locator('button[data-action="start"]')).toHaveCount(0);
  await expect(power).toContainText('stopping, then stopped');
  await power.locator('button[data-action="stop"]').click();
  await expect(page.getByTestId('vm-state')).toHaveText('stopped', { timeout: 60_000 });
  await expect(power.locator('button[data-action="stop"]')).toHaveCount(0);
  await power.locator('button[data-action="start"]').click();
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  await power.locator('button[data-action="reboot"]').click();
  await expect(page.locator('h2', { hasText: 'Last job: reboot' })).toContainText('succeeded', { timeout: 60_000 });
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  await expect(page.getByTestId('assigned-devices').locator('li')).toHaveCount(1);

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
  // No name: one is made up, as CloudAPI makes them.
  await page.getByRole('button', { name: 'Create instance' }).click();
  const heading = page.getByRole('heading', { name: /^Instance [0-9a-f]{8}$/ });
  await expect(heading).toBeVisible();
  const made = ((await heading.textContent()) as string).replace('Instance ', '');
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await page.getByRole('button', { name: `Yes, destroy ${made}` }).click();
  await expect(page.getByTestId('vm-state')).toHaveText('destroyed', { timeout: 60_000 });
  expect(problems).toEqual([]);
});

test('tenant: SSH keys; an instance on a chosen network with user-data shows its address, ssh command and console', async ({ page }) => {
  const problems = watchConsole(page);
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  // A public network on the simulated nodes' bridge, not a default one.
  const net = await api(admin, 'POST', '/networks', {
    name: 'e2e-tenants', subnet: '10.78.0.0/24', gateway: '10.78.0.1', bridge: 'br0', public: true,
  });
  expect([201, 409]).toContain(net.status);
  const t = await newTenant('keys', 1);
  await signIn(page, t.login, t.password);

  // Keys: a bad one is refused with the parser's reason next to the field.
  await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'SSH keys' }).click();
  await expect(page.getByRole('heading', { name: 'SSH keys' })).toBeVisible();
  await expect(page.getByText('You have no SSH keys yet')).toBeVisible();
  await hydrated(page);
  await page.locator('#k-name').fill('broken');
  await page.locator('#k-key').fill('ssh-ed25519 not-a-key');
  await page.getByRole('button', { name: 'Add key' }).click();
  await expect(page.locator('#key-error')).not.toBeEmpty();
  await expect(page.locator('tr[data-key="broken"]')).toHaveCount(0);

  // Good ones are listed with their fingerprints.
  for (const name of ['laptop', 'spare']) {
    await page.locator('#k-name').fill(name);
    await page.locator('#k-key').fill(sshKey(`${name}@e2e`));
    await page.getByRole('button', { name: 'Add key' }).click();
    await expect(page.locator(`tr[data-key="${name}"]`).getByTestId('fingerprint')).toHaveText(/^SHA256:[A-Za-z0-9+/]{43}$/);
  }
  await expect(page.locator('#key-error')).toBeEmpty();

  // Deleting one asks first.
  await page.getByRole('link', { name: 'Delete spare' }).click();
  await page.getByRole('button', { name: 'Yes, delete spare' }).click();
  await expect(page.locator('tr[data-key="spare"]')).toHaveCount(0);
  await expect(page.locator('tr[data-key="laptop"]')).toBeVisible();

  // Create on the network, with user-data.
  await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Create instance' }).click();
  await hydrated(page);
  const box = page.locator('.networks [data-network="e2e-tenants"]').getByRole('checkbox');
  await expect(box).not.toBeChecked();
  await box.check();
  await page.locator('#alias').fill('net-1');
  await page.locator(`.offer[data-package="${PACKAGE}"]`).getByRole('radio').check();
  await page.locator('#user_data').fill('#cloud-config\nruncmd:\n  - echo hello\n');
  await page.getByRole('button', { name: 'Create instance' }).click();
  await expect(page).toHaveURL(/\/instances\/[0-9a-f-]{36}$/);
  const uuid = page.url().split('/').pop() as string;
  await expect(page.getByRole('heading', { name: 'Instance net-1' })).toBeVisible();

  // Its address on that network, primary, and the command to log in (the e2e image
  // names no default user: root).
  const nic = page.getByTestId('nics').locator('li[data-primary="true"]');
  await expect(nic).toContainText(/10\.78\.0\.\d+ on e2e-tenants/);
  await expect(nic).toContainText('primary');
  const ip = (await nic.getAttribute('data-ip')) as string;
  await expect(page.getByTestId('ssh-command')).toHaveText(`ssh root@${ip}`);
  await expect(page.getByRole('button', { name: 'Copy' })).toBeVisible();
  const vm = await api(admin, 'GET', `/vms/${uuid}`);
  expect(vm.body.primary_ip).toBe(ip);
  const nets = await api(admin, 'GET', '/networks');
  const netUuid = (nets.body as Array<{ uuid: string; name: string }>).find((n) => n.name === 'e2e-tenants')?.uuid;
  expect(vm.body.nics.map((n: { network_uuid: string }) => n.network_uuid)).toEqual([netUuid]);

  // The keys it was given: all the tenant's, as none were chosen.
  await expect(page.getByTestId('vm-keys').locator('li')).toHaveCount(1);
  await expect(page.getByTestId('vm-keys').locator('li[data-key="laptop"]')).toContainText(/SHA256:/);

  // Tags, added, changed in place and removed; numbers and booleans keep their type.
  const tags = page.getByTestId('tags');
  await hydrated(page);
  const add = page.getByTestId('add-tag');
  for (const [k, v] of [['team', 'ml'], ['gpus', '2']]) {
    await add.getByLabel('Name').fill(k);
    await add.getByLabel('Value').fill(v);
    await add.getByRole('button', { name: 'Add tag' }).click();
    await expect(tags.locator(`tr[data-tag="${k}"]`)).toBeVisible();
  }
  await expect(tags.locator('tr[data-tag="gpus"] input[name="value"]')).toHaveAttribute('data-kind', 'number');
  await tags.getByLabel('Value of team').fill('vision');
  await tags.locator('tr[data-tag="team"]').getByRole('button', { name: 'Save' }).click();
  await expect(tags.getByLabel('Value of team')).toHaveValue('vision');
  await tags.locator('tr[data-tag="gpus"]').getByRole('button', { name: 'Remove' }).click();
  await expect(tags.locator('tr[data-tag="gpus"]')).toHaveCount(0);
  const tagged = await api(admin, 'GET', `/vms/${uuid}/tags`);
  expect(tagged.body).toEqual({ team: 'vision' });

  // The console panel is there while it boots and runs, and shows no error.
  await expect(page.getByTestId('vm-state')).toHaveText('running', { timeout: 60_000 });
  const consolePanel = page.getByTestId('console');
  await expect(consolePanel).toBeVisible();
  await expect(consolePanel.getByRole('heading', { name: 'Console' })).toBeVisible();
  await expect(consolePanel.locator('.error')).toHaveCount(0);

  // The terminal: the node's serial port through the console websocket, drawn by xterm.js
  // (the simulated VM's stand-in answers a login and `echo`), under the page's CSP.
  const terminal = page.getByTestId('terminal');
  await terminal.getByRole('button', { name: 'Open terminal' }).click();
  await expect(terminal.getByTestId('terminal-status')).toHaveText('Connected.', { timeout: 20_000 });
  const rows = terminal.locator('.xterm-rows');
  await expect(rows).toContainText('login:', { timeout: 20_000 });
  await terminal.locator('.xterm-helper-textarea').focus();
  await page.keyboard.type('keys');
  await page.keyboard.press('Enter');
  await expect(rows).toContainText('Password:');
  await page.keyboard.type('any');
  await page.keyboard.press('Enter');
  await page.keyboard.type('echo from-the-portal');
  await page.keyboard.press('Enter');
  await expect(rows).toContainText(/from-the-portal.*from-the-portal/);
  await terminal.getByRole('button', { name: 'Close terminal' }).click();
  await expect(terminal.getByTestId('terminal-status')).toHaveText('');

  // Destroyed: calmly said to have no console, and its address is free again.
  await page.getByRole('link', { name: 'Destroy instance' }).click();
  await page.getByRole('button', { name: 'Yes, destroy net-1' }).click();
  await expect(page.getByTestId('vm-state')).toHaveText('destroyed', { timeout: 60_000 });
  await page.reload();
  await expect(consolePanel.getByTestId('console-unavailable')).toBeVisible();
  await expect(page.getByTestId('ssh-command')).toHaveCount(0);
  await removeNetwork('e2e-tenants');
  expect(problems).toEqual([]);
});
