//! Two "machines" for one test: two network namespaces joined by a
//! virtual Ethernet pair, each with its own (non-loopback) address.
//! Creating them needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN) and `ip` from
//! iproute2; `TwoHosts::create` says why it could not.

use std::process::Command;

use super::CREDENTIAL_ENV;

/// Two network namespaces joined by a veth pair: `a` holds `10.231.N.1`,
/// `b` holds `10.231.N.2`. Removed on drop (with the veth pair).
pub(crate) struct TwoHosts {
    /// The first namespace's name.
    pub(crate) a: String,
    /// The second namespace's name.
    pub(crate) b: String,
    subnet: u32,
    /// What names its namespaces and veth ends.
    id: String,
}

fn ip(args: &[&str]) -> Result<(), String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("ip {}: {e}", args.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

impl TwoHosts {
    /// Creates the pair.
    ///
    /// # Errors
    /// Without root or `ip netns`: why.
    pub(crate) fn create() -> Result<TwoHosts, String> {
        // The tests of this file run at once: each pair of hosts gets its
        // own names and subnet.
        static PAIRS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let pair = PAIRS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let id = format!("{}{pair}", std::process::id());
        let subnet = (std::process::id() * 4 + pair) % 250 + 1;
        let hosts = TwoHosts {
            a: format!("wrpc-{id}-a"),
            b: format!("wrpc-{id}-b"),
            subnet,
            id: id.clone(),
        };
        let (veth_a, veth_b) = (format!("wra{id}"), format!("wrb{id}"));
        ip(&["netns", "add", &hosts.a])?;
        ip(&["netns", "add", &hosts.b])?;
        ip(&[
            "link", "add", &veth_a, "netns", &hosts.a, "type", "veth", "peer", "name", &veth_b,
            "netns", &hosts.b,
        ])?;
        for (ns, veth, host) in [(&hosts.a, &veth_a, 1), (&hosts.b, &veth_b, 2)] {
            let addr = format!("10.231.{subnet}.{host}/24");
            ip(&["-n", ns, "addr", "add", &addr, "dev", veth])?;
            ip(&["-n", ns, "link", "set", veth, "up"])?;
            ip(&["-n", ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// Takes host `a`'s end of the link down (a pulled cable).
    ///
    /// # Errors
    /// What `ip` said.
    pub(crate) fn cut_link(&self) -> Result<(), String> {
        ip(&[
            "-n",
            &self.a,
            "link",
            "set",
            &format!("wra{}", self.id),
            "down",
        ])
    }

    /// The address of host 1 (`a`) or 2 (`b`).
    pub(crate) fn addr(&self, host: u32) -> String {
        format!("10.231.{}.{host}", self.subnet)
    }

    /// `wasmrpc ARGS` inside namespace `ns`, with no inherited credentials.
    pub(crate) fn wasmrpc(&self, ns: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", ns, env!("CARGO_BIN_EXE_wasmrpc")])
            .args(args)
            .env("RUST_LOG", "info");
        for var in CREDENTIAL_ENV {
            cmd.env_remove(var);
        }
        cmd
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        let _ = ip(&["netns", "del", &self.a]);
        let _ = ip(&["netns", "del", &self.b]);
    }
}
