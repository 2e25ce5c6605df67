//! Our workers rendezvous on the store `torchrun`'s agent hosts (PyTorch's
//! own TCPStore server), as clients, and exchange values.

mod common;

use std::time::Duration;

use common::{timed, torch_tool};
use tokio::process::Command;

#[tokio::test]
async fn torchrun_workers_rendezvous_on_the_agent_store() {
    let Some(torchrun) = torch_tool("torchrun") else {
        return;
    };
    timed(Duration::from_secs(180), async {
        let output = Command::new(&torchrun)
            .args(["--no-python", "--standalone", "--nproc-per-node", "2"])
            .arg(env!("CARGO_BIN_EXE_torchrun_rendezvous"))
            .kill_on_drop(true)
            .output()
            .await
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "torchrun failed ({}):\n{stdout}\n{stderr}",
            output.status
        );
        for rank in 0..2 {
            let line = format!(r#"rank {rank}/2: got ["hello from 0", "hello from 1"]"#);
            assert!(
                stdout.lines().any(|l| l == line),
                "missing {line:?} in:\n{stdout}\n{stderr}"
            );
        }
    })
    .await;
}
