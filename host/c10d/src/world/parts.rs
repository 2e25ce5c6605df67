//! Multi-part collectives (`all_gather_coalesced`): the parts are issued in
//! order at the first poll and joined, the first error winning.

use crate::error::Result;

/// One part of a multi-part collective.
pub(super) type PartFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<()>> + Send>>;

/// Runs `parts` to completion, polling the pending ones in index order
/// every time (so the first poll issues them in order); the first error
/// wins once every part has finished.
pub(super) async fn join_in_order(parts: Vec<PartFuture>) -> Result<()> {
    let mut parts: Vec<Option<PartFuture>> = parts.into_iter().map(Some).collect();
    let mut first_error = None;
    std::future::poll_fn(|cx| {
        for slot in &mut parts {
            if let Some(part) = slot
                && let std::task::Poll::Ready(result) = part.as_mut().poll(cx)
            {
                *slot = None;
                if let Err(e) = result
                    && first_error.is_none()
                {
                    first_error = Some(e);
                }
            }
        }
        if parts.iter().all(Option::is_none) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    first_error.map_or(Ok(()), Err)
}
