//! Creations first: while creations are coming in, job steps start at a bounded rate, one
//! every [`JobPacer`]'s interval, instead of all at once; the steps still waiting when
//! creations stop all go then.
//!
//! Each creation's answer queues its provision job; the first steps of a few hundred jobs
//! (their claims, the reservation's check, the first task queued) reached the database
//! together and shared its CPUs with the placement batches that the next creations wait
//! for: the slowest 1 % of a Postgres run's answers all came from that burst. A job waits
//! for its node for seconds anyway; a creation's caller waits for the answer.

use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

pub struct JobPacer {
    every: Duration,
    /// The earliest time the next paced step may start.
    next: Mutex<Instant>,
    /// Wakes every step still waiting for its turn once creations stop: turns handed out
    /// during a burst reach as far ahead as there are steps waiting (1,024 jobs at 10 ms:
    /// 10 s), and nothing is gained by keeping them once the burst is over.
    calm: Notify,
}

impl JobPacer {
    /// Steps paced one per `every`; `Duration::ZERO`: never paced.
    pub fn new(every: Duration) -> Self {
        JobPacer {
            every,
            next: Mutex::new(Instant::now()),
            calm: Notify::new(),
        }
    }

    /// Waits for this step's turn if `busy` says creations are coming in; at once
    /// otherwise. Turns are handed out in order of asking. When the step whose turn comes
    /// finds creations have stopped, every waiting step goes at once: the burst's end is
    /// seen within one interval.
    pub async fn turn(&self, busy: impl Fn() -> bool) {
        // Made before the turn is taken: it hears a wake-up sent any time after.
        let calm = self.calm.notified();
        let Some(at) = self.slot(busy(), Instant::now()) else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep_until(at) => {
                if !busy() {
                    self.calmed(Instant::now());
                }
            }
            () = calm => {}
        }
    }

    /// When a step asking at `now` may start; `None`: at once, and no turn taken.
    fn slot(&self, busy: bool, now: Instant) -> Option<Instant> {
        if !busy || self.every.is_zero() {
            return None;
        }
        // Only an instant is kept under the lock: a panic elsewhere breaks nothing.
        let mut next = self.next.lock().unwrap_or_else(|p| p.into_inner());
        let at = (*next).max(now);
        *next = at + self.every;
        Some(at)
    }

    /// Creations have stopped: the turns handed out are void, and the first step of the
    /// next burst starts at once.
    fn calmed(&self, now: Instant) {
        *self.next.lock().unwrap_or_else(|p| p.into_inner()) = now;
        self.calm.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_turns_are_spaced_and_idle_ones_are_not() {
        let ms = Duration::from_millis;
        let p = JobPacer::new(ms(10));
        let t0 = Instant::now();
        assert_eq!(p.slot(false, t0), None, "never paced while idle");
        // Five steps asking at once: the first at once, then one each 10 ms.
        let slots: Vec<_> = (0..5).map(|_| p.slot(true, t0)).collect();
        let want: Vec<_> = (0..5).map(|i| Some(t0 + ms(10 * i))).collect();
        assert_eq!(slots, want);
        // Idle asks take no turn; a later busy ask queues behind the last turn given…
        assert_eq!(p.slot(false, t0), None);
        assert_eq!(p.slot(true, t0 + ms(20)), Some(t0 + ms(50)));
        // …and one after a quiet spell starts at once.
        assert_eq!(p.slot(true, t0 + ms(500)), Some(t0 + ms(500)));
        let off = JobPacer::new(Duration::ZERO);
        assert_eq!(off.slot(true, t0), None, "an interval of zero never paces");
        // Calm again: the turns ahead are void.
        p.calmed(t0 + ms(600));
        assert_eq!(p.slot(true, t0 + ms(600)), Some(t0 + ms(600)));
    }

    #[tokio::test]
    async fn waiting_steps_go_when_creations_stop() {
        let secs = Duration::from_secs;
        let p = std::sync::Arc::new(JobPacer::new(secs(2)));
        let busy = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
        let t0 = Instant::now();
        let mut steps = tokio::task::JoinSet::new();
        // Turns at 0, 2, 4 and 6 s, in order of asking: the first goes at once.
        for _ in 0..4 {
            let (p, busy) = (p.clone(), busy.clone());
            steps.spawn(async move {
                p.turn(|| busy.load(std::sync::atomic::Ordering::SeqCst))
                    .await;
                Instant::now() - t0
            });
            tokio::task::yield_now().await;
        }
        let first = steps.join_next().await;
        assert!(first.is_some_and(|r| r.is_ok_and(|d| d < secs(2))));
        busy.store(false, std::sync::atomic::Ordering::SeqCst);
        // The second turn (2 s) sees the calm and lets the steps whose turns were 4 and 6 s
        // away go with it.
        let rest = tokio::time::timeout(secs(30), steps.join_all()).await;
        let went = rest.unwrap_or_default();
        assert_eq!(went.len(), 3, "every step went");
        assert!(
            went.iter().all(|d| *d >= secs(2) && *d < secs(4)),
            "{went:?}"
        );
        // A step asking now goes at once.
        let at_once = tokio::time::timeout(Duration::ZERO, p.turn(|| false)).await;
        assert!(at_once.is_ok());
    }
}
