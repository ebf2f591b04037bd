import * as fs from 'fs';
import * as path from 'path';

export default async function globalTeardown() {
  const file = path.join(__dirname, '.env.json');
  if (!fs.existsSync(file)) return;
  const { dir, pids } = JSON.parse(fs.readFileSync(file, 'utf8')) as { dir: string; pids: number[] };
  for (const pid of pids.reverse()) {
    try {
      process.kill(pid, 'SIGTERM');
    } catch {
      // already gone
    }
  }
  await new Promise((r) => setTimeout(r, 500));
  fs.unlinkSync(file);
  // Logs stay when a test failed (the run's output names the folder).
  if (!process.env.PASSAGE_E2E_KEEP) fs.rmSync(dir, { recursive: true, force: true });
}
