//! The TCP connections established on this machine (every process's), read from /proc/net/tcp
//! and tcp6: how many clients an etcd holds, and whether a client's connection is still the same.

/// A connection seen from one end: that end's port and the other end's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Established {
    pub local_port: u16,
    pub remote_port: u16,
}

/// Every ESTABLISHED socket on this machine (both ends of a loopback connection show, one each).
pub fn established_connections() -> Vec<Established> {
    let port_of = |address: &str| address.rsplit(':').next().and_then(|hex| u16::from_str_radix(hex, 16).ok());
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let mut fields = line.split_whitespace();
            let (Some(local), Some(remote), Some(state)) = (fields.nth(1), fields.next(), fields.next()) else {
                continue;
            };
            // 01: ESTABLISHED.
            if let ("01", Some(local_port), Some(remote_port)) = (state, port_of(local), port_of(remote)) {
                found.push(Established { local_port, remote_port });
            }
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_connection_shows_from_both_ends() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let server = listener.local_addr().expect("addr").port();
        let stream = std::net::TcpStream::connect(("127.0.0.1", server)).expect("connect");
        let client = stream.local_addr().expect("addr").port();
        let _accepted = listener.accept().expect("accept");
        let all = established_connections();
        assert!(all.contains(&Established { local_port: server, remote_port: client }), "{all:?}");
        assert!(all.contains(&Established { local_port: client, remote_port: server }), "{all:?}");
    }
}
