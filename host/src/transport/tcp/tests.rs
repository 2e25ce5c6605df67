//! Tests of `tcp`.

use super::*;

#[test]
fn refusals_are_logged_at_most_once_per_interval_with_a_count() {
    let log = RefusalLog::default();
    let t0 = std::time::Instant::now();
    let ms = |i: u64| t0 + std::time::Duration::from_millis(i);
    assert_eq!(log.note(t0), Refusal::Log(0));
    assert_eq!(log.note(ms(4)), Refusal::FirstSuppressed);
    for i in 2..200 {
        assert_eq!(log.note(ms(i * 4)), Refusal::Suppressed);
    }
    assert_eq!(log.note(t0 + REFUSAL_LOG_INTERVAL), Refusal::Log(199));
    assert_eq!(log.note(t0 + REFUSAL_LOG_INTERVAL * 3), Refusal::Log(0));
    // Refusals that no later one reports are flushed once.
    assert_eq!(log.note(ms(3100)), Refusal::FirstSuppressed);
    assert_eq!(log.note(ms(3200)), Refusal::Suppressed);
    assert_eq!(log.flush(ms(4004)), Some(2));
    assert_eq!(log.flush(ms(4005)), None);
    // The flush counts as a line: the next refusal within a second waits.
    assert_eq!(log.note(ms(4500)), Refusal::FirstSuppressed);
}
