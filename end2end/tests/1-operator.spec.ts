import { test, expect } from '@playwright/test';
import { ADMIN_PASSWORD, GPUS, IMAGE, NODES, PACKAGE, VARIANT, api, apiToken, hydrated, newTenant, signIn, watchConsole } from './helpers';

test('operator: sign in, variant, package, tenant, servers and devices with correct counts', async ({ page }) => {
  const problems = watchConsole(page);
  const total = NODES() * GPUS();

  // A wrong password is said plainly and nobody is signed in.
  await page.goto('/login');
  await hydrated(page);
  await page.locator('#login').fill('admin');
  await page.locator('#password').fill('not-the-password');
  await page.getByRole('button', { name: 'Sign in' }).click();
  await expect(page.locator('#password-error')).toHaveText('Wrong login or password.');

  await signIn(page, 'admin', ADMIN_PASSWORD());
  await expect(page).toHaveURL(/\/admin$/);
  await expect(page.getByRole('heading', { name: 'Fleet overview' })).toBeVisible();
  await expect(page.getByTestId('servers-up')).toHaveText(String(NODES()));

  // Variant: matches every GPU of the fake nodes.
  await page.getByRole('link', { name: 'Variants' }).click();
  await expect(page.getByRole('heading', { name: 'Device variants' })).toBeVisible();
  await hydrated(page);
  await page.locator('#v-name').fill(VARIANT);
  await page.locator('#v-vendor').fill('10de');
  await page.locator('#v-device').fill('2330');
  await page.locator('#v-description').fill('H100 SXM 80GB');
  await page.getByRole('button', { name: 'Create variant' }).click();
  const row = page.locator(`tr[data-variant="${VARIANT}"]`);
  await expect(row).toBeVisible();
  await expect(row.getByTestId('matches')).toHaveText(`${total} devices`);

  // Edit it in place: the new description shows, the match count stays.
  await row.getByRole('link', { name: `Edit ${VARIANT}` }).click();
  await expect(page.getByRole('heading', { name: `Edit variant ${VARIANT}` })).toBeVisible();
  await hydrated(page);
  await page.locator('#v-description').fill('H100 SXM5 80GB');
  await page.getByRole('button', { name: 'Save variant' }).click();
  await expect(page.getByRole('heading', { name: 'New variant' })).toBeVisible();
  await expect(row).toContainText('H100 SXM5 80GB');
  await expect(row.getByTestId('matches')).toHaveText(`${total} devices`);

  // Package with one of them.
  await page.getByRole('link', { name: 'Packages' }).click();
  await expect(page.getByRole('heading', { name: 'Packages' })).toBeVisible();
  await hydrated(page);
  await page.locator('#p-name').fill(PACKAGE);
  await page.locator(`#p-dev-${VARIANT}`).fill('1');
  await page.getByRole('button', { name: 'Create package' }).click();
  await expect(page.locator(`tr[data-package="${PACKAGE}"]`)).toContainText(`1 × ${VARIANT}`);

  // A package can be deleted again.
  await page.locator('#p-name').fill('short-lived');
  await page.locator(`#p-dev-${VARIANT}`).fill('');
  await page.getByRole('button', { name: 'Create package' }).click();
  await expect(page.locator('tr[data-package="short-lived"]')).toBeVisible();
  await page.getByRole('button', { name: 'Delete short-lived' }).click();
  await expect(page.locator('tr[data-package="short-lived"]')).toHaveCount(0);

  // A tenant with a GPU quota.
  await page.getByRole('link', { name: 'Accounts' }).click();
  await hydrated(page);
  await page.locator('#a-login').fill('alice');
  await page.locator('#a-password').fill('alice-password-1');
  await page.locator('#a-quota').fill('2');
  await page.getByRole('button', { name: 'Create account' }).click();
  const alice = page.locator('tr[data-login="alice"]');
  await expect(alice).toBeVisible();
  await expect(alice.getByRole('textbox')).toHaveValue('2');
  await alice.getByRole('textbox').fill('3');
  await alice.getByRole('button', { name: 'Set quota of alice' }).click();
  await expect(page.getByText('Quota saved.')).toBeVisible();
  await page.reload();
  await expect(page.locator('tr[data-login="alice"]').getByRole('textbox')).toHaveValue('3');

  // Servers: each node with its GPUs, all unassigned.
  await page.getByRole('link', { name: 'Servers' }).click();
  const servers = page.getByTestId('servers').locator('tbody tr');
  await expect(servers).toHaveCount(NODES());
  for (let k = 1; k <= NODES(); k++) {
    const r = page.locator(`tr[data-hostname="e2e-node-${k}"]`);
    await expect(r.locator('td[data-state="total"]')).toHaveText(String(GPUS()));
    await expect(r.locator('td[data-state="unassigned"]')).toHaveText(String(GPUS()));
    await expect(r).toContainText('running');
  }

  // A server's own page lists its devices with BDF, variant, state, NUMA node, driver.
  await page.getByRole('link', { name: 'e2e-node-1' }).click();
  await expect(page.getByRole('heading', { name: 'Server e2e-node-1' })).toBeVisible();
  await expect(page.getByTestId('devices').locator('tbody tr')).toHaveCount(GPUS());
  await expect(page.getByTestId('devices').locator('tbody tr').first()).toContainText(VARIANT);
  // Its vCPUs and memory as the agent read them from the tree (64 CPUs, 512 GiB less the
  // host's 4 GiB).
  await expect(page.getByTestId('vcpus')).toHaveText(/ of 64 allocated$/);
  await expect(page.getByTestId('memory')).toHaveText(/ of 520192 MiB allocated$/);

  // Devices: filtered in SQL by state.
  await page.goto('/admin/devices?state=unassigned');
  await expect(page.getByTestId('devices').locator('tbody tr')).toHaveCount(total);
  await expect(page.locator('.pager')).toContainText(`Showing ${total} of ${total}`);
  await page.goto('/admin/devices?state=used');
  await expect(page.getByTestId('devices').locator('tbody tr')).toHaveCount(0);

  // Overview capacity table agrees.
  await page.goto('/admin');
  const cap = page.getByTestId('capacity').locator(`tr[data-variant="${VARIANT}"]`);
  await expect(cap.locator('td[data-state="total"]')).toHaveText(String(total));
  await expect(cap.locator('td[data-state="unassigned"]')).toHaveText(String(total));

  // Join token: the command to add a node.
  await page.goto('/admin/servers');
  await hydrated(page);
  await page.getByText('Add a server').click();
  await page.getByRole('button', { name: 'Create join token' }).click();
  await expect(page.getByTestId('join-command')).toContainText('node-agent run --server http://');

  expect(problems).toEqual([]);
});

test('operator: bad variant input shows an inline error and saves nothing', async ({ page }) => {
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.goto('/admin/variants');
  await hydrated(page);
  await page.locator('#v-name').fill('BROKEN_VARIANT');
  await page.locator('#v-vendor').fill('zzzz');
  await page.locator('#v-device').fill('2330');
  await page.getByRole('button', { name: 'Create variant' }).click();
  await expect(page.locator('#vendor-error')).not.toBeEmpty();
  await expect(page.locator('#vendor-error')).toContainText(/hex|vendor/i);
  await page.reload();
  await expect(page.getByTestId('variants')).toBeVisible();
  await expect(page.locator('tr[data-variant="BROKEN_VARIANT"]')).toHaveCount(0);

  // A package with a non-number vCPU count: the field says so, nothing is created.
  await page.goto('/admin/packages');
  await hydrated(page);
  await page.locator('#p-name').fill('broken-package');
  await page.locator('#p-vcpus').fill('many');
  await page.getByRole('button', { name: 'Create package' }).click();
  await expect(page.locator('#vcpus-error')).toContainText('whole number');
  // A device count that is no number: said next to its variant.
  await page.locator('#p-vcpus').fill('8');
  await page.locator(`#p-dev-${VARIANT}`).fill('two');
  await page.getByRole('button', { name: 'Create package' }).click();
  await expect(page.locator(`[id="devices.${VARIANT}-error"]`)).toContainText('whole number');
  await page.reload();
  await expect(page.locator('tr[data-package="broken-package"]')).toHaveCount(0);
});

test('operator: a package asks for devices of several variants at once', async ({ page }) => {
  const problems = watchConsole(page);
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  for (const v of [
    { name: 'E2E_FPGA', type: 'fpga', vendor: '1172', device: '0e3b' },
    { name: 'E2E_NIC', type: 'nic', vendor: '15b3', device: '101d' },
  ]) {
    const r = await api(admin, 'POST', '/variants', v);
    expect([201, 409]).toContain(r.status);
  }
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.goto('/admin/packages');
  await hydrated(page);
  await page.locator('#p-name').fill('gpu-fpga');
  await page.locator('#p-dev-E2E_FPGA').fill('1');
  await page.locator('#p-dev-E2E_NIC').fill('0');
  await page.locator('#p-dev-NVIDIA_H100').fill('2');
  await page.getByRole('button', { name: 'Create package' }).click();
  const row = page.locator('tr[data-package="gpu-fpga"]');
  await expect(row.getByTestId('devices')).toHaveText('1 × E2E_FPGA, 2 × NVIDIA_H100');
  const packages = await api(admin, 'GET', '/packages');
  const made = (packages.body as Array<{ name: string; devices: Record<string, number> }>).find((p) => p.name === 'gpu-fpga');
  expect(made?.devices).toEqual({ E2E_FPGA: 1, NVIDIA_H100: 2 });
  expect(problems).toEqual([]);
});

/** A qcow2 file as far as the server checks one: the magic, version 3, then any bytes. */
function qcow2(bytes: number): Buffer {
  const b = Buffer.alloc(bytes, 0x11);
  b.write('QFI\xfb', 0, 'latin1');
  b.writeUInt32BE(3, 4);
  return b;
}

/** Where screenshots for people go, when asked for (PASSAGE_SCREENS_DIR). */
async function screenshot(page: import('@playwright/test').Page, name: string) {
  const dir = process.env.PASSAGE_SCREENS_DIR;
  if (dir) await page.screenshot({ path: `${dir}/${name}.png`, fullPage: true });
}

test('operator: create an image, upload its file with progress, see its VMs, disable it', async ({ page }) => {
  const problems = watchConsole(page);
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Images', exact: true }).click();
  await expect(page.getByRole('heading', { name: 'Images', exact: true })).toBeVisible();
  await hydrated(page);
  // The image every test boots is listed, active, with its size.
  const e2e = page.locator('tr[data-image="e2e"]');
  await expect(e2e.getByTestId('state')).toHaveText('active');
  await expect(e2e.getByTestId('size')).toHaveText('1.0 MiB');
  await expect(e2e.getByTestId('bootrom')).toHaveText('default');

  // A bad name is said next to its field.
  await page.locator('#i-name').fill('no spaces');
  await page.locator('#i-version').fill('1');
  await page.getByRole('button', { name: 'Create image' }).click();
  await expect(page.locator('#name-error')).toContainText('characters');

  // Private (not public), so the tenants' create page keeps offering only the e2e image.
  await page.locator('#i-name').fill('uploaded');
  await page.locator('#i-version').fill('1');
  await page.locator('#i-type').selectOption('qcow2');
  await page.locator('#i-description').fill('made in the portal');
  await page.locator('#i-user').fill('debian');
  await page.locator('#i-disk').fill('1');
  await page.locator('#i-bootrom').selectOption('bios');
  await page.getByRole('button', { name: 'Create image' }).click();
  await expect(page).toHaveURL(/\/admin\/images\/[0-9a-f-]{36}$/);
  const uuid = page.url().split('/').pop() as string;
  await expect(page.getByRole('heading', { name: 'Image uploaded@1' })).toBeVisible();
  await expect(page.getByTestId('image-state')).toHaveText('unactivated');
  await expect(page.getByTestId('image-size')).toHaveText('-');
  await expect(page.getByTestId('image-bootrom')).toHaveText('bios');
  const made = await api(admin, 'GET', `/images/${uuid}`);
  expect(made.body.requirements).toEqual({ min_disk_gib: 1, bootrom: 'bios' });
  await hydrated(page);

  // Upload through the page: the bar reaches 100 % and the image turns active.
  const file = qcow2(3 << 20);
  if (process.env.PASSAGE_SCREENS_DIR) {
    // Slowed down for a picture of the bar on its way.
    const cdp = await page.context().newCDPSession(page);
    await cdp.send('Network.enable');
    await cdp.send('Network.emulateNetworkConditions', {
      offline: false, latency: 0, downloadThroughput: -1, uploadThroughput: 1 << 20,
    });
  }
  await page.locator('#u-file').setInputFiles({ name: 'disk.qcow2', mimeType: 'application/octet-stream', buffer: file });
  await page.getByRole('button', { name: 'Upload' }).click();
  if (process.env.PASSAGE_SCREENS_DIR) {
    await expect(page.getByTestId('upload-text')).toHaveText(/ [4-9]\d %$/);
    await screenshot(page, 'image-uploading');
  }
  await expect(page.getByTestId('upload-text')).toHaveText('3.0 MiB of 3.0 MiB, 100 %');
  const bar = page.getByTestId('upload-progress').locator('progress');
  await expect(bar).toHaveAttribute('value', String(file.length));
  await expect(bar).toHaveAttribute('max', String(file.length));
  await expect(page.getByTestId('upload-progress')).toContainText('uploaded and checked');
  await expect(page.getByTestId('image-state')).toHaveText('active');
  await expect(page.getByTestId('image-size')).toHaveText('3.0 MiB');
  await expect(page.getByTestId('image-sha256')).toHaveText(/^[0-9a-f]{64}$/);
  await screenshot(page, 'image-uploaded');

  // A VM built from it (a package without devices leaves the GPUs to the other tests).
  const pkg = await api(admin, 'POST', '/packages', { name: 'no-gpu', vcpus: 1, memory_mib: 1024, disk_gib: 10, devices: {} });
  expect(pkg.status).toBe(201);
  const vm = await api(admin, 'POST', '/vms', { alias: 'from-uploaded', package: 'no-gpu', image: uuid });
  expect(vm.status).toBe(202);
  await page.reload();
  await expect(page.getByTestId('image-vm-count')).toHaveText('(1)');
  const vmRow = page.getByTestId('image-vms').locator(`tr[data-vm="${vm.body.uuid}"]`);
  await expect(vmRow.getByRole('link', { name: 'from-uploaded' })).toHaveAttribute('href', `/instances/${vm.body.uuid}`);

  // The list agrees: active, its size, its VM, who sees it.
  await page.goto('/admin/images');
  const row = page.locator('tr[data-image="uploaded"]');
  await expect(row.getByTestId('state')).toHaveText('active');
  await expect(row.getByTestId('size')).toHaveText('3.0 MiB');
  await expect(row.getByTestId('vm-count')).toHaveText('1');
  await expect(row.getByTestId('bootrom')).toHaveText('bios');
  await expect(row).toContainText('private to admin');
  await screenshot(page, 'images-list');

  // Deleting it while a VM uses it disables it, after asking.
  await row.getByRole('link', { name: 'uploaded' }).click();
  await hydrated(page);
  await page.getByRole('link', { name: 'Disable image' }).click();
  await page.getByRole('button', { name: 'Yes, disable uploaded@1' }).click();
  await expect(page.getByTestId('image-state')).toHaveText('disabled');

  // A file that fails the server's check: its message, and the image is failed.
  const bad = await api(admin, 'POST', '/images', { name: 'mislabelled', version: '1', os: 'linux', type: 'raw' });
  expect(bad.status).toBe(201);
  await page.goto(`/admin/images/${bad.body.uuid}`);
  await hydrated(page);
  await page.locator('#u-file').setInputFiles({ name: 'disk.qcow2', mimeType: 'application/octet-stream', buffer: qcow2(4096) });
  await page.getByRole('button', { name: 'Upload' }).click();
  await expect(page.getByTestId('upload-error')).toContainText('qcow2, not raw');
  await expect(page.getByTestId('image-state')).toHaveText('failed');
  await screenshot(page, 'image-failed');

  // Leave the catalog and the fleet as they were: a package without devices would fit
  // tenants without GPU quota, whom other tests expect to find nothing chosen for them.
  await expect(async () => {
    const r = await api(admin, 'DELETE', `/vms/${vm.body.uuid}`);
    expect(r.status).toBe(202);
  }).toPass({ timeout: 60_000 });
  const gone = await api(admin, 'DELETE', `/packages/${pkg.body.uuid}`);
  expect(gone.status).toBe(204);
  await api(admin, 'DELETE', `/images/${bad.body.uuid}`);
  expect(problems).toEqual([]);
});

test('operator: a network made in the portal, listed, its addresses in use, refused deletion while in use, edited', async ({ page }) => {
  const problems = watchConsole(page);
  const admin = await apiToken('admin', ADMIN_PASSWORD());
  await signIn(page, 'admin', ADMIN_PASSWORD());
  await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Networks', exact: true }).click();
  await expect(page.getByRole('heading', { name: 'Networks', exact: true })).toBeVisible();
  await hydrated(page);

  // A subnet the service refuses: its reason next to the field, nothing made.
  await page.locator('#n-name').fill('e2e-ops');
  await page.locator('#n-subnet').fill('10.77.0.0/33');
  await page.getByRole('button', { name: 'Create network' }).click();
  await expect(page.locator('#subnet-error')).not.toBeEmpty();
  await expect(page.locator('tr[data-network="e2e-ops"]')).toHaveCount(0);

  // Simulated nodes have the bridge br0, the form's default.
  await page.locator('#n-subnet').fill('10.77.0.0/24');
  await page.locator('#n-gateway').fill('10.77.0.1');
  await page.locator('#n-start').fill('10.77.0.10');
  await page.locator('#n-end').fill('10.77.0.50');
  await page.locator('#n-resolvers').fill('10.77.0.1, 9.9.9.9');
  await page.locator('#n-description').fill('made in the portal');
  await page.getByRole('button', { name: 'Create network' }).click();
  await expect(page).toHaveURL(/\/admin\/networks\/[0-9a-f-]{36}$/);
  const uuid = page.url().split('/').pop() as string;
  await expect(page.getByRole('heading', { name: 'Network e2e-ops' })).toBeVisible();
  await expect(page.getByTestId('address-count')).toHaveText('(0)');
  await expect(page.locator('.facts')).toContainText('10.77.0.10 – 10.77.0.50');
  await expect(page.locator('.facts')).toContainText('10.77.0.1, 9.9.9.9');

  // The list shows it.
  await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name: 'Networks', exact: true }).click();
  const row = page.locator('tr[data-network="e2e-ops"]');
  await expect(row).toContainText('10.77.0.0/24');
  await expect(row).toContainText('br0');
  await expect(row.getByTestId('in-use')).toHaveText('0');

  // A VM on it holds an address: the network's page says which, and whose.
  const vm = await api(admin, 'POST', '/vms', { alias: 'on-e2e-ops', package: PACKAGE, image: IMAGE, networks: ['e2e-ops'] });
  expect(vm.status).toBe(202);
  const vmUuid = vm.body.uuid as string;
  await page.goto(`/admin/networks/${uuid}`);
  const addr = page.getByTestId('addresses').locator(`tr[data-vm="${vmUuid}"]`);
  await expect(addr).toHaveAttribute('data-ip', /^10\.77\.0\.(1\d|[2-4]\d|50)$/);
  await expect(addr).toContainText(/([0-9a-f]{2}:){5}[0-9a-f]{2}/);
  await expect(addr.getByRole('link', { name: 'on-e2e-ops' })).toHaveAttribute('href', `/instances/${vmUuid}`);
  await expect(addr).toContainText('admin');
  await expect(page.getByTestId('address-count')).toHaveText('(1)');
  const ip = (await addr.getAttribute('data-ip')) as string;

  // The operator's VM list shows its address.
  await page.goto('/admin/vms');
  await expect(page.locator(`tr[data-vm="${vmUuid}"]`).getByTestId('ips')).toHaveText(ip);

  // Deleting it while the address is held: asked first, then refused with the reason.
  await page.goto(`/admin/networks/${uuid}`);
  await hydrated(page);
  await page.getByRole('link', { name: 'Delete network' }).click();
  await expect(page.getByRole('heading', { name: 'Delete e2e-ops?' })).toBeVisible();
  await page.getByRole('button', { name: 'Yes, delete e2e-ops' }).click();
  await expect(page.locator('.error')).toContainText('in use');
  await page.goto('/admin/networks');
  await expect(page.locator('tr[data-network="e2e-ops"]').getByTestId('in-use')).toHaveText('1');

  // Once the VM is gone, so is its address, and the network can go.
  expect((await api(admin, 'DELETE', `/vms/${vmUuid}`)).status).toBe(202);
  await expect(async () => {
    const r = await api(admin, 'GET', `/networks/${uuid}/ips`);
    expect(r.body).toEqual([]);
  }).toPass({ timeout: 60_000 });

  // Edited: the form holds its values, keeps the subnet read-only, refuses a bad MTU and
  // an unknown owner next to their fields, and takes owners by login.
  const owner = await newTenant('e2e-netowner');
  await page.goto(`/admin/networks/${uuid}`);
  await hydrated(page);
  await page.getByRole('link', { name: 'Edit network' }).click();
  await expect(page).toHaveURL(new RegExp(`/admin/networks/${uuid}/edit$`));
  await expect(page.getByRole('heading', { name: 'Edit network e2e-ops' })).toBeVisible();
  await expect(page.locator('#n-name')).toHaveValue('e2e-ops');
  await expect(page.locator('#n-resolvers')).toHaveValue('10.77.0.1, 9.9.9.9');
  await expect(page.locator('#n-mtu')).toHaveValue('1500');
  await expect(page.locator('#n-description')).toHaveValue('made in the portal');
  await expect(page.locator('#n-subnet')).toHaveCount(0);
  await expect(page.locator('.facts')).toContainText('10.77.0.0/24');
  await hydrated(page);
  await page.locator('#n-mtu').fill('100');
  await page.getByRole('button', { name: 'Save network' }).click();
  await expect(page.locator('#mtu-error')).not.toBeEmpty();
  await page.locator('#n-mtu').fill('9000');
  await page.locator('#n-owners').fill('no-such-login-e2e');
  await page.getByRole('button', { name: 'Save network' }).click();
  await expect(page.locator('#owner_uuids-error')).toContainText('no-such-login-e2e');
  await expect(page.locator('#mtu-error')).toBeEmpty();
  await page.locator('#n-name').fill('e2e-ops2');
  await page.locator('#n-resolvers').fill('1.1.1.1 8.8.8.8');
  await page.locator('#n-owners').fill(owner.login);
  await page.getByRole('button', { name: 'Save network' }).click();
  await expect(page).toHaveURL(new RegExp(`/admin/networks/${uuid}$`));
  await expect(page.getByRole('heading', { name: 'Network e2e-ops2' })).toBeVisible();
  await expect(page.locator('.facts')).toContainText('1.1.1.1, 8.8.8.8');
  await expect(page.locator('.facts')).toContainText('9000');
  await expect(page.getByTestId('owners')).toHaveText(owner.login);
  const saved = await api(admin, 'GET', `/networks/${uuid}`);
  expect(saved.body.owner_uuids).toEqual([owner.uuid]);
  expect(saved.body.mtu).toBe(9000);

  await page.goto(`/admin/networks/${uuid}?confirm=delete`);
  await hydrated(page);
  await page.getByRole('button', { name: 'Yes, delete e2e-ops2' }).click();
  await expect(page).toHaveURL(/\/admin\/networks$/);
  await expect(page.locator('tr[data-network="e2e-ops2"]')).toHaveCount(0);
  expect(problems).toEqual([]);
});
