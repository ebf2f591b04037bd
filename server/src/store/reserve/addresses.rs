//! Addresses on networks, reserved in a creation's transaction beside its devices. A
//! network's row is the lock (taken in key order on Postgres, before the servers' rows;
//! on SQLite the one writer is lock enough); `network_ips`' primary key is the guard:
//! an address another writer holds fails the insert, and the transaction with it.
//!
//! The search for free addresses starts at the network's cursor (just after the last one
//! handed out, as NAPI does) and reads the taken addresses after it a page at a time, so
//! a creation reads a handful of rows, not the whole range, however full the network.

use super::super::{StoreError, StoreResult, now_ms, parse_uuid};
use passage_model::networks::{AddressPlan, Nic, local_mac};
use passage_model::{AccountId, NetworkId, VmId};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::Ipv4Addr;

/// A NIC a new VM asks for: an address on `network`, `fixed` or the next free one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NicWant {
    pub network: NetworkId,
    pub fixed: Option<Ipv4Addr>,
}

/// Taken addresses read per query while looking for free ones.
const PAGE: i64 = 256;

/// A network as the reservation reads it.
struct Pool {
    name: String,
    plan: AddressPlan,
    cursor: u32,
    /// Free addresses found for this batch, in the order they go out.
    free: VecDeque<Ipv4Addr>,
    /// Fixed addresses asked for in this batch that are held already (by whom).
    held: HashMap<Ipv4Addr, String>,
}

/// What the batch's VMs got: for each, its NICs or why not, and where each network's
/// next search starts.
pub struct Grants {
    pub nics: Vec<Result<Vec<Nic>, StoreError>>,
    cursors: BTreeMap<NetworkId, u32>,
}

#[derive(sqlx::FromRow)]
struct PoolRow {
    uuid: String,
    name: String,
    subnet: String,
    gateway: Option<String>,
    provision_start_ip: String,
    provision_end_ip: String,
    next_ip: i64,
}

impl PoolRow {
    fn into_pool(self) -> StoreResult<(NetworkId, Pool)> {
        let plan = AddressPlan::new(
            &self.subnet,
            self.gateway.as_deref(),
            Some(&self.provision_start_ip),
            Some(&self.provision_end_ip),
        )
        .map_err(|e| StoreError::Corrupt(format!("network {}: {}", self.uuid, e.message)))?;
        Ok((
            parse_uuid(&self.uuid, "network")?,
            Pool {
                name: self.name,
                plan,
                cursor: u32::try_from(self.next_ip).unwrap_or(0),
                free: VecDeque::new(),
                held: HashMap::new(),
            },
        ))
    }
}

const POOL_COLS: &str =
    "uuid, name, subnet, gateway, provision_start_ip, provision_end_ip, next_ip";

fn mac() -> String {
    local_mac(rand::random())
}

/// The held addresses of a network in `[lo, hi]`, ascending, at most [`PAGE`] of them.
trait Taken {
    fn taken(
        &mut self,
        network: &str,
        lo: u32,
        hi: u32,
    ) -> impl Future<Output = StoreResult<Vec<u32>>> + Send;
}

/// `need` free addresses of `pool`, looked for from its cursor up to the range's end,
/// then from its start up to the cursor, skipping `skip` (fixed addresses asked for in
/// the same batch).
async fn find_free<T: Taken>(
    pool: &Pool,
    network: &str,
    need: usize,
    skip: &BTreeSet<Ipv4Addr>,
    rows: &mut T,
) -> StoreResult<Vec<Ipv4Addr>> {
    let (lo, hi) = (u32::from(pool.plan.start), u32::from(pool.plan.end));
    let from = pool.cursor.clamp(lo, hi);
    let mut found = Vec::with_capacity(need);
    let consider = |a: u32, found: &mut Vec<Ipv4Addr>| {
        let ip = Ipv4Addr::from(a);
        if pool.plan.assignable(ip) && !skip.contains(&ip) {
            found.push(ip);
        }
    };
    let mut spans = vec![(from, hi)];
    if from > lo {
        spans.push((lo, from - 1));
    }
    for (start, end) in spans {
        // `next` is the first address of the span not yet looked at; u64 so that the
        // step past the range's last address cannot wrap.
        let mut next = u64::from(start);
        while found.len() < need && next <= u64::from(end) {
            let page_lo = u32::try_from(next).unwrap_or(u32::MAX);
            let page = rows.taken(network, page_lo, end).await?;
            for t in &page {
                while next < u64::from(*t) && found.len() < need {
                    consider(u32::try_from(next).unwrap_or(u32::MAX), &mut found);
                    next += 1;
                }
                next = next.max(u64::from(*t) + 1);
                if found.len() == need {
                    break;
                }
            }
            if (page.len() as i64) < PAGE {
                // Nothing else is taken up to the span's end.
                while next <= u64::from(end) && found.len() < need {
                    consider(u32::try_from(next).unwrap_or(u32::MAX), &mut found);
                    next += 1;
                }
                break;
            }
        }
        if found.len() == need {
            break;
        }
    }
    Ok(found)
}

/// Gives each VM its NICs in order, from what the pools hold, as if each had asked alone:
/// a VM refused gives back what it took.
fn assign(
    wants: &[&[NicWant]],
    pools: &mut BTreeMap<NetworkId, Pool>,
) -> Vec<Result<Vec<Nic>, StoreError>> {
    let mut fixed_given: BTreeSet<(NetworkId, Ipv4Addr)> = BTreeSet::new();
    let mut out = Vec::with_capacity(wants.len());
    for vm_wants in wants {
        let mut nics: Vec<Nic> = Vec::with_capacity(vm_wants.len());
        let mut taken_dynamic: Vec<(NetworkId, Ipv4Addr)> = Vec::new();
        let mut taken_fixed: Vec<(NetworkId, Ipv4Addr)> = Vec::new();
        let mut refusal = None;
        for (i, w) in vm_wants.iter().enumerate() {
            let Some(pool) = pools.get_mut(&w.network) else {
                refusal = Some(StoreError::Conflict(format!(
                    "network {} was deleted",
                    w.network
                )));
                break;
            };
            let ip = match w.fixed {
                Some(ip) => {
                    if !pool.plan.fixable(ip) {
                        refusal = Some(StoreError::Conflict(format!(
                            "{ip} is not an address network {} can give: it must be a host \
                             of {} other than its gateway",
                            pool.name, pool.plan.subnet
                        )));
                        break;
                    }
                    if let Some(by) = pool.held.get(&ip) {
                        refusal = Some(StoreError::Conflict(format!(
                            "{ip} on network {} is in use by VM {by}",
                            pool.name
                        )));
                        break;
                    }
                    if !fixed_given.insert((w.network, ip)) {
                        refusal = Some(StoreError::Conflict(format!(
                            "{ip} on network {} is in use by another new VM",
                            pool.name
                        )));
                        break;
                    }
                    taken_fixed.push((w.network, ip));
                    ip
                }
                None => match pool.free.pop_front() {
                    Some(ip) => {
                        taken_dynamic.push((w.network, ip));
                        ip
                    }
                    None => {
                        refusal = Some(StoreError::Exhausted(format!(
                            "network {} has no free address: all {} of its range are in use",
                            pool.name,
                            pool.plan.capacity()
                        )));
                        break;
                    }
                },
            };
            nics.push(Nic {
                mac: mac(),
                ip,
                network_uuid: w.network,
                primary: i == 0,
            });
        }
        match refusal {
            None => out.push(Ok(nics)),
            Some(e) => {
                for (net, ip) in taken_dynamic.into_iter().rev() {
                    if let Some(p) = pools.get_mut(&net) {
                        p.free.push_front(ip);
                    }
                }
                for key in taken_fixed {
                    fixed_given.remove(&key);
                }
                out.push(Err(e));
            }
        }
    }
    out
}

/// The cursors after a batch: just past the last address handed out on each network.
fn cursors(
    grants: &[Result<Vec<Nic>, StoreError>],
    wants: &[&[NicWant]],
) -> BTreeMap<NetworkId, u32> {
    let mut c: BTreeMap<NetworkId, u32> = BTreeMap::new();
    for (g, w) in grants.iter().zip(wants) {
        let Ok(nics) = g else { continue };
        for (nic, want) in nics.iter().zip(w.iter()) {
            if want.fixed.is_none() {
                c.insert(nic.network_uuid, u32::from(nic.ip).saturating_add(1));
            }
        }
    }
    c
}

/// Addresses inside a creation's transaction.
pub trait AddressTx {
    /// Locks the networks `wants` name and decides each VM's NICs, in order; writes
    /// nothing.
    fn grant(&mut self, wants: &[&[NicWant]]) -> impl Future<Output = StoreResult<Grants>> + Send;

    /// Holds the NICs of the VMs that won everything else, and moves the cursors.
    fn hold(
        &mut self,
        grants: &Grants,
        winners: &[(VmId, AccountId, &[Nic])],
    ) -> impl Future<Output = StoreResult<()>> + Send;
}

macro_rules! impl_address_tx {
    ($db:ty, $lock:expr) => {
        impl Taken for sqlx::Transaction<'_, $db> {
            async fn taken(&mut self, network: &str, lo: u32, hi: u32) -> StoreResult<Vec<u32>> {
                let rows: Vec<(i64,)> = sqlx::query_as(
                    "SELECT ip FROM network_ips WHERE network_uuid = $1 \
                     AND ip >= $2 AND ip <= $3 ORDER BY ip LIMIT $4",
                )
                .bind(network)
                .bind(i64::from(lo))
                .bind(i64::from(hi))
                .bind(PAGE)
                .fetch_all(&mut **self)
                .await?;
                Ok(rows
                    .into_iter()
                    .filter_map(|(ip,)| u32::try_from(ip).ok())
                    .collect())
            }
        }

        impl AddressTx for sqlx::Transaction<'_, $db> {
            async fn grant(&mut self, wants: &[&[NicWant]]) -> StoreResult<Grants> {
                let nets: BTreeSet<NetworkId> = wants
                    .iter()
                    .flat_map(|w| w.iter().map(|n| n.network))
                    .collect();
                if nets.is_empty() {
                    return Ok(Grants {
                        nics: wants.iter().map(|_| Ok(Vec::new())).collect(),
                        cursors: BTreeMap::new(),
                    });
                }
                let mut pools: BTreeMap<NetworkId, Pool> = BTreeMap::new();
                // One at a time, in key order: the order every creation locks them in.
                for net in &nets {
                    let row: Option<PoolRow> = sqlx::query_as(&format!(
                        "SELECT {POOL_COLS} FROM networks WHERE uuid = $1{}",
                        $lock
                    ))
                    .bind(net.to_string())
                    .fetch_optional(&mut **self)
                    .await?;
                    if let Some(row) = row {
                        let (id, pool) = row.into_pool()?;
                        pools.insert(id, pool);
                    }
                }
                for (net, pool) in pools.iter_mut() {
                    let fixed: BTreeSet<Ipv4Addr> = wants
                        .iter()
                        .flat_map(|w| w.iter())
                        .filter(|w| w.network == *net)
                        .filter_map(|w| w.fixed)
                        .collect();
                    for ip in &fixed {
                        let by: Option<(String,)> = sqlx::query_as(
                            "SELECT vm_uuid FROM network_ips WHERE network_uuid = $1 AND ip = $2",
                        )
                        .bind(net.to_string())
                        .bind(i64::from(u32::from(*ip)))
                        .fetch_optional(&mut **self)
                        .await?;
                        if let Some((vm,)) = by {
                            pool.held.insert(*ip, vm);
                        }
                    }
                    let need = wants
                        .iter()
                        .flat_map(|w| w.iter())
                        .filter(|w| w.network == *net && w.fixed.is_none())
                        .count();
                    if need == 0 {
                        continue;
                    }
                    let free = find_free(pool, &net.to_string(), need, &fixed, self).await?;
                    pool.free = free.into();
                }
                let nics = assign(wants, &mut pools);
                let cursors = cursors(&nics, wants);
                Ok(Grants { nics, cursors })
            }

            async fn hold(
                &mut self,
                grants: &Grants,
                winners: &[(VmId, AccountId, &[Nic])],
            ) -> StoreResult<()> {
                let now = now_ms();
                for (vm, owner, nics) in winners {
                    for (i, nic) in nics.iter().enumerate() {
                        sqlx::query(
                            "INSERT INTO network_ips (network_uuid, ip, mac, vm_uuid, \
                             owner_uuid, nic_index, created_at) \
                             VALUES ($1, $2, $3, $4, $5, $6, $7)",
                        )
                        .bind(nic.network_uuid.to_string())
                        .bind(i64::from(u32::from(nic.ip)))
                        .bind(&nic.mac)
                        .bind(vm.to_string())
                        .bind(owner.to_string())
                        .bind(i as i64)
                        .bind(now)
                        .execute(&mut **self)
                        .await
                        .map_err(|e| match &e {
                            sqlx::Error::Database(d) if d.is_unique_violation() => {
                                StoreError::Retry
                            }
                            _ => StoreError::Sqlx(e),
                        })?;
                    }
                }
                for (net, cursor) in &grants.cursors {
                    sqlx::query("UPDATE networks SET next_ip = $2 WHERE uuid = $1")
                        .bind(net.to_string())
                        .bind(i64::from(*cursor))
                        .execute(&mut **self)
                        .await?;
                }
                Ok(())
            }
        }
    };
}

impl_address_tx!(sqlx::Sqlite, "");
impl_address_tx!(sqlx::Postgres, " FOR NO KEY UPDATE");

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(subnet: &str, gw: Option<&str>, cursor: &str) -> Pool {
        let plan = AddressPlan::new(subnet, gw, None, None).unwrap_or_else(|e| panic!("{e:?}"));
        Pool {
            name: "n".into(),
            plan,
            cursor: u32::from(cursor.parse::<Ipv4Addr>().unwrap_or_else(|e| panic!("{e}"))),
            free: VecDeque::new(),
            held: HashMap::new(),
        }
    }

    fn ips(v: &[&str]) -> Vec<Ipv4Addr> {
        v.iter()
            .map(|s| s.parse().unwrap_or_else(|e| panic!("{s}: {e}")))
            .collect()
    }

    /// Answers pages of taken addresses as the store's query does, counting the queries.
    struct Held {
        taken: Vec<u32>,
        calls: usize,
    }

    impl Taken for Held {
        async fn taken(&mut self, _: &str, lo: u32, hi: u32) -> StoreResult<Vec<u32>> {
            self.calls += 1;
            Ok(self
                .taken
                .iter()
                .copied()
                .filter(|t| lo <= *t && *t <= hi)
                .take(PAGE as usize)
                .collect())
        }
    }

    async fn run(p: &Pool, need: usize, taken: &[&str], skip: &[&str]) -> (Vec<Ipv4Addr>, usize) {
        let mut held = Held {
            taken: ips(taken).into_iter().map(u32::from).collect(),
            calls: 0,
        };
        let skip: BTreeSet<Ipv4Addr> = ips(skip).into_iter().collect();
        let found = find_free(p, "n", need, &skip, &mut held)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        (found, held.calls)
    }

    #[tokio::test]
    async fn the_search_starts_at_the_cursor_and_wraps() {
        let p = pool("10.0.0.0/29", Some("10.0.0.1"), "10.0.0.5");
        // Hosts .1-.6; .1 the gateway.
        let (found, _) = run(&p, 3, &["10.0.0.6"], &[]).await;
        assert_eq!(found, ips(&["10.0.0.5", "10.0.0.2", "10.0.0.3"]));
        let (found, _) = run(&p, 9, &["10.0.0.3"], &["10.0.0.4"]).await;
        assert_eq!(found, ips(&["10.0.0.5", "10.0.0.6", "10.0.0.2"]));
    }

    #[tokio::test]
    async fn a_full_network_finds_nothing() {
        let p = pool("10.0.0.0/30", None, "0.0.0.0");
        let (found, _) = run(&p, 1, &["10.0.0.1", "10.0.0.2"], &[]).await;
        assert!(found.is_empty());
    }

    #[tokio::test]
    async fn pages_of_taken_addresses_are_read_until_a_gap() {
        let p = pool("10.1.0.0/16", None, "10.1.0.1");
        let taken: Vec<String> = (1..=600)
            .map(|k| format!("10.1.{}.{}", k / 256, k % 256))
            .collect();
        let taken: Vec<&str> = taken.iter().map(String::as_str).collect();
        let (found, calls) = run(&p, 2, &taken, &[]).await;
        assert_eq!(found, ips(&["10.1.2.89", "10.1.2.90"]));
        assert_eq!(calls, 3, "600 taken addresses in pages of {PAGE}");
    }

    #[test]
    fn a_refused_vm_gives_back_what_it_took() {
        let a = NetworkId::new_random();
        let b = NetworkId::new_random();
        let mut pools = BTreeMap::new();
        let mut pa = pool("10.0.0.0/29", None, "0.0.0.0");
        pa.free = ips(&["10.0.0.1"]).into();
        let pb = pool("10.0.1.0/29", None, "0.0.0.0");
        pools.insert(a, pa);
        pools.insert(b, pb);
        let both = [
            NicWant {
                network: a,
                fixed: None,
            },
            NicWant {
                network: b,
                fixed: None,
            },
        ];
        let only_a = [NicWant {
            network: a,
            fixed: None,
        }];
        let got = assign(&[&both, &only_a], &mut pools);
        assert!(matches!(got[0], Err(StoreError::Exhausted(_))));
        let second = got[1].as_ref().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(second[0].ip, ips(&["10.0.0.1"])[0]);
        assert!(second[0].primary);
    }

    #[test]
    fn a_fixed_address_goes_once() {
        let a = NetworkId::new_random();
        let mut pools = BTreeMap::new();
        let mut pa = pool("10.0.0.0/29", Some("10.0.0.1"), "0.0.0.0");
        pa.held.insert(ips(&["10.0.0.3"])[0], "vm-x".into());
        pools.insert(a, pa);
        let want = |ip: &str| {
            [NicWant {
                network: a,
                fixed: Some(ips(&[ip])[0]),
            }]
        };
        let (w1, w2, w3, w4) = (
            want("10.0.0.2"),
            want("10.0.0.2"),
            want("10.0.0.3"),
            want("10.0.0.1"),
        );
        let got = assign(&[&w1, &w2, &w3, &w4], &mut pools);
        assert!(got[0].is_ok());
        for (g, why) in [
            (&got[1], "another new VM"),
            (&got[2], "vm-x"),
            (&got[3], "gateway"),
        ] {
            match g {
                Err(StoreError::Conflict(m)) => assert!(m.contains(why), "{m}"),
                other => panic!("{other:?}"),
            }
        }
    }
}
