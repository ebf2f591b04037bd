import { test, expect, Page } from '@playwright/test';
import { ADMIN_PASSWORD, ensureCatalog, hydrated, newTenant, signIn } from './helpers';

const STAFF_PAGES: Array<[string, string]> = [
  ['/admin', 'Overview'],
  ['/admin/servers', 'Servers'],
  ['/admin/devices', 'Devices'],
  ['/admin/variants', 'Variants'],
  ['/admin/packages', 'Packages'],
  ['/admin/images', 'Images'],
  ['/admin/networks', 'Networks'],
  ['/admin/accounts', 'Accounts'],
  ['/admin/vms', 'VMs'],
  ['/admin/jobs', 'Jobs'],
];

/** The main menu's links that say they are the current page, and those drawn underlined. */
async function marked(page: Page): Promise<{ current: string[]; underlined: string[] }> {
  const links = page.getByRole('navigation', { name: 'Main' }).getByRole('link');
  const current: string[] = [];
  const underlined: string[] = [];
  for (const link of await links.all()) {
    const name = (await link.textContent())?.trim() ?? '';
    if (await link.getAttribute('aria-current')) current.push(name);
    const line = await link.evaluate((a) => getComputedStyle(a).textDecorationLine);
    if (line.includes('underline')) underlined.push(name);
  }
  return { current, underlined };
}

test('the menu marks only the page you are on', async ({ page }) => {
  await signIn(page, 'admin', ADMIN_PASSWORD());
  // Served pages, as a first visit or a page without scripts sees them.
  for (const [path, name] of STAFF_PAGES) {
    await page.goto(path);
    await expect(page.getByRole('link', { name, exact: true })).toHaveAttribute('aria-current', 'page');
    expect(await marked(page), path).toEqual({ current: [name], underlined: [name] });
  }
  // Moving around in the hydrated app: the mark follows.
  await page.goto('/admin');
  await hydrated(page);
  for (const [path, name] of [...STAFF_PAGES.slice(1), STAFF_PAGES[0]]) {
    await page.getByRole('navigation', { name: 'Main' }).getByRole('link', { name, exact: true }).click();
    await expect(page).toHaveURL(new RegExp(`${path}$`));
    await expect(page.getByRole('link', { name, exact: true })).toHaveAttribute('aria-current', 'page');
    expect(await marked(page), path).toEqual({ current: [name], underlined: [name] });
  }
  // A page below a menu entry marks that entry, and only it.
  await page.goto('/admin/servers');
  await page.getByTestId('servers').getByRole('link').first().click();
  await expect(page.getByRole('heading', { name: /^Server / })).toBeVisible();
  await expect(page.getByRole('link', { name: 'Servers', exact: true })).toHaveAttribute('aria-current', 'true');
  expect(await marked(page)).toEqual({ current: ['Servers'], underlined: ['Servers'] });

  const t = await newTenant('menu');
  await page.context().clearCookies();
  await signIn(page, t.login, t.password);
  for (const [path, name] of [['/instances', 'My instances'], ['/instances/new', 'Create instance'], ['/keys', 'SSH keys']]) {
    await page.goto(path);
    expect(await marked(page), path).toEqual({ current: [name], underlined: [name] });
  }
});

test('the capacity legend never draws a label over another', async ({ page }) => {
  await ensureCatalog();
  await signIn(page, 'admin', ADMIN_PASSWORD());
  for (const width of [1280, 700, 360]) {
    await page.setViewportSize({ width, height: 900 });
    await page.goto('/admin');
    const items = page.getByTestId('capacity-legend').locator('li');
    await expect(items).toHaveCount(8);
    await expect(items.first()).toHaveText('unassigned');
    const boxes = [];
    for (const item of await items.all()) {
      const b = await item.boundingBox();
      expect(b).not.toBeNull();
      if (b) boxes.push({ name: await item.textContent(), ...b });
    }
    for (let i = 0; i < boxes.length; i++) {
      for (let j = i + 1; j < boxes.length; j++) {
        const [a, b] = [boxes[i], boxes[j]];
        const apart = a.x + a.width <= b.x || b.x + b.width <= a.x || a.y + a.height <= b.y || b.y + b.height <= a.y;
        expect(apart, `${a.name} and ${b.name} overlap at ${width} px`).toBe(true);
      }
    }
    await test.info().attach(`overview-${width}.png`, {
      body: await page.locator('section[aria-labelledby="cap-h"]').screenshot(),
      contentType: 'image/png',
    });
  }
});
