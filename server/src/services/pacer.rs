//! Creations first: while creations are coming in, job steps start at a bounded rate, one
//! every [`JobPacer`]'s interval, instead of all at once.
//!
//! Each creation's answer queues its provision job; the first steps of a few hundred jobs
//! (their claims, the reservation's check, the first task queued) reached the database
//! together and shared its CPUs with the placement batches that the next creations wait
//! for: the slowest 1 % of a Postgres run's answers all came from that burst. A job waits
//! for its node for seconds anyway; a creation's caller waits for the answer.

use std::sync::Mutex;
use std::time::Duration;
use tokio::time::Instant;

pub struct JobPacer {
    every: Duration,
    /// The earliest time the next paced step may start.
    next: Mutex<Instant>,
}

impl JobPacer {
    /// Steps paced one per `every`; `Duration::ZERO`: never paced.
    pub fn new(every: Duration) -> Self {
        JobPacer {
            every,
            next: Mutex::new(Instant::now()),
        }
    }

    /// Waits for this step's turn if `busy` says creations are coming in; at once
    /// otherwise. Turns are handed out in order of asking.
    pub async fn turn(&self, busy: bool) {
        if let Some(at) = self.slot(busy, Instant::now()) {
            tokio::time::sleep_until(at).await;
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
    }
}
