//! Networks and the tenants a non-public one is for. Every write takes the lock of the
//! one `network_writes` row first, so the check that a new subnet overlaps none on its
//! bridge and VLAN cannot race another creation (on SQLite the one writer is lock enough;
//! the statement is the same there).

use super::{Db, StoreError, StoreResult, now_ms, parse_uuid, to_time, unique_as_conflict};
use crate::{in_tx, on_read};
use passage_model::networks::{AddressPlan, Network, NetworkIp};
use passage_model::{AccountId, NetworkId};
use std::collections::HashMap;
use std::net::IpAddr;

#[derive(sqlx::FromRow)]
struct NetworkRow {
    uuid: String,
    name: String,
    subnet: String,
    gateway: Option<String>,
    provision_start_ip: String,
    provision_end_ip: String,
    resolvers: String,
    vlan_id: i64,
    bridge: String,
    mtu: i64,
    public: i64,
    is_default: i64,
    description: Option<String>,
    created_at: i64,
}

const COLS: &str = "uuid, name, subnet, gateway, provision_start_ip, provision_end_ip, \
    resolvers, vlan_id, bridge, mtu, public, is_default, description, created_at";

impl NetworkRow {
    fn into_view(self, owners: Vec<AccountId>) -> StoreResult<Network> {
        let corrupt = |what: &str| StoreError::Corrupt(format!("network {}: {what}", self.uuid));
        let ip = |s: &str, what: &str| s.parse().map_err(|_| corrupt(what));
        Ok(Network {
            uuid: parse_uuid(&self.uuid, "network")?,
            gateway: self
                .gateway
                .as_deref()
                .map(|g| ip(g, "gateway"))
                .transpose()?,
            provision_start_ip: ip(&self.provision_start_ip, "provision_start_ip")?,
            provision_end_ip: ip(&self.provision_end_ip, "provision_end_ip")?,
            resolvers: serde_json::from_str(&self.resolvers).map_err(|_| corrupt("resolvers"))?,
            vlan_id: u16::try_from(self.vlan_id).map_err(|_| corrupt("vlan_id"))?,
            mtu: u32::try_from(self.mtu).map_err(|_| corrupt("mtu"))?,
            public: self.public != 0,
            owner_uuids: owners,
            default: self.is_default != 0,
            created_at: to_time(self.created_at),
            name: self.name,
            subnet: self.subnet,
            bridge: self.bridge,
            description: self.description,
        })
    }
}

/// The first statement of every network write (see the module's comment).
const TAKE_WRITE_LOCK: &str = "UPDATE network_writes SET writes = writes + 1";

fn resolvers_text(r: &[IpAddr]) -> StoreResult<String> {
    serde_json::to_string(r).map_err(|e| StoreError::Corrupt(format!("resolvers: {e}")))
}

pub struct NewNetwork<'a> {
    pub name: &'a str,
    pub plan: AddressPlan,
    pub resolvers: &'a [IpAddr],
    pub vlan_id: u16,
    pub bridge: &'a str,
    pub mtu: u32,
    pub public: bool,
    pub owners: &'a [AccountId],
    pub default: bool,
    pub description: Option<&'a str>,
}

/// Adds `$owners` to network `$uuid` inside transaction `$tx` (either backend: the
/// statement's text is the same for both).
macro_rules! add_owners {
    ($tx:ident, $uuid:expr, $owners:expr) => {
        for owner in $owners {
            sqlx::query(
                "INSERT INTO network_owners (network_uuid, account_uuid) VALUES ($1, $2) \
                 ON CONFLICT DO NOTHING",
            )
            .bind($uuid.to_string())
            .bind(owner.to_string())
            .execute(&mut *$tx)
            .await?;
        }
    };
}

fn name_taken(name: &str) -> impl FnOnce() -> String + '_ {
    move || format!("a network named {name:?} exists")
}

pub async fn insert(db: &Db, n: NewNetwork<'_>) -> StoreResult<Network> {
    let uuid = NetworkId::new_random();
    let first = i64::from(u32::from(n.plan.subnet.network()));
    let last = i64::from(u32::from(n.plan.subnet.broadcast()));
    let resolvers = resolvers_text(n.resolvers)?;
    in_tx!(db, |tx| {
        sqlx::query(TAKE_WRITE_LOCK).execute(&mut *tx).await?;
        let clash: Option<(String, String)> = sqlx::query_as(
            "SELECT name, subnet FROM networks WHERE bridge = $1 AND vlan_id = $2 \
             AND subnet_first <= $4 AND subnet_last >= $3 LIMIT 1",
        )
        .bind(n.bridge)
        .bind(i64::from(n.vlan_id))
        .bind(first)
        .bind(last)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some((name, subnet)) = clash {
            return Err(StoreError::Conflict(format!(
                "subnet {} overlaps network {name:?} ({subnet}) on bridge {} VLAN {}",
                n.plan.subnet, n.bridge, n.vlan_id
            )));
        }
        sqlx::query(&format!(
            "INSERT INTO networks ({COLS}, subnet_first, subnet_last) VALUES \
             ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16)"
        ))
        .bind(uuid.to_string())
        .bind(n.name)
        .bind(n.plan.subnet.to_string())
        .bind(n.plan.gateway.map(|g| g.to_string()))
        .bind(n.plan.start.to_string())
        .bind(n.plan.end.to_string())
        .bind(&resolvers)
        .bind(i64::from(n.vlan_id))
        .bind(n.bridge)
        .bind(i64::from(n.mtu))
        .bind(i64::from(n.public))
        .bind(i64::from(n.default))
        .bind(n.description)
        .bind(now_ms())
        .bind(first)
        .bind(last)
        .execute(&mut *tx)
        .await
        .map_err(|e| unique_as_conflict(e, name_taken(n.name)))?;
        add_owners!(tx, uuid, n.owners);
        Ok(())
    })?;
    get(db, uuid).await
}

/// The owners of `networks`, by network.
async fn owners_of(db: &Db, networks: &[String]) -> StoreResult<HashMap<String, Vec<AccountId>>> {
    let mut by = HashMap::new();
    if networks.is_empty() {
        return Ok(by);
    }
    let marks: Vec<String> = (1..=networks.len()).map(|i| format!("${i}")).collect();
    let sql = format!(
        "SELECT network_uuid, account_uuid FROM network_owners WHERE network_uuid IN ({}) \
         ORDER BY account_uuid",
        marks.join(", ")
    );
    let rows: Vec<(String, String)> = on_read!(db, |c| {
        let mut q = sqlx::query_as(&sql);
        for n in networks {
            q = q.bind(n);
        }
        q.fetch_all(c).await
    })?;
    for (network, account) in rows {
        let a: AccountId = parse_uuid(&account, "network owner")?;
        by.entry(network).or_insert_with(Vec::new).push(a);
    }
    Ok(by)
}

/// The rows as networks, each with its owners.
async fn with_owners(db: &Db, rows: Vec<NetworkRow>) -> StoreResult<Vec<Network>> {
    let uuids: Vec<String> = rows.iter().map(|r| r.uuid.clone()).collect();
    let mut owners = owners_of(db, &uuids).await?;
    rows.into_iter()
        .map(|r| {
            let o = owners.remove(&r.uuid).unwrap_or_default();
            r.into_view(o)
        })
        .collect()
}

pub async fn get(db: &Db, uuid: NetworkId) -> StoreResult<Network> {
    let row: Option<NetworkRow> = on_read!(db, |c| sqlx::query_as(&format!(
        "SELECT {COLS} FROM networks WHERE uuid = $1"
    ))
    .bind(uuid.to_string())
    .fetch_optional(c)
    .await)?;
    let row = row.ok_or(StoreError::NotFound("network"))?;
    let mut owners = owners_of(db, std::slice::from_ref(&row.uuid)).await?;
    let mine = owners.remove(&row.uuid).unwrap_or_default();
    row.into_view(mine)
}

/// The network named `name`.
pub async fn by_name(db: &Db, name: &str) -> StoreResult<Network> {
    let uuid: Option<String> = on_read!(db, |c| sqlx::query_scalar(
        "SELECT uuid FROM networks WHERE name = $1"
    )
    .bind(name)
    .fetch_optional(c)
    .await)?;
    let uuid = uuid.ok_or(StoreError::NotFound("network"))?;
    get(db, parse_uuid(&uuid, "network")?).await
}

/// Newest first, with the total; `visible_to`: a tenant's view (public networks and
/// those it owns).
pub async fn list(
    db: &Db,
    visible_to: Option<AccountId>,
    limit: i64,
    offset: i64,
) -> StoreResult<(Vec<Network>, i64)> {
    let filter = "WHERE ($1 = '' OR public = 1 OR uuid IN \
         (SELECT network_uuid FROM network_owners WHERE account_uuid = $1))";
    let who = visible_to.map(|a| a.to_string()).unwrap_or_default();
    let sql = format!(
        "SELECT {COLS} FROM networks {filter} ORDER BY created_at DESC, uuid DESC \
         LIMIT $2 OFFSET $3"
    );
    let rows: Vec<NetworkRow> = on_read!(db, |c| sqlx::query_as(&sql)
        .bind(&who)
        .bind(limit)
        .bind(offset)
        .fetch_all(c)
        .await)?;
    let count = format!("SELECT COUNT(*) FROM networks {filter}");
    let total: i64 = on_read!(db, |c| sqlx::query_scalar(&count)
        .bind(&who)
        .fetch_one(c)
        .await)?;
    let items = with_owners(db, rows).await?;
    Ok((items, total))
}

/// What an update changes; `None` keeps a field.
#[derive(Default)]
pub struct Changes<'a> {
    pub name: Option<&'a str>,
    pub resolvers: Option<&'a [IpAddr]>,
    pub mtu: Option<u32>,
    pub public: Option<bool>,
    pub owners: Option<&'a [AccountId]>,
    pub default: Option<bool>,
    /// `Some(None)` removes it.
    pub description: Option<Option<&'a str>>,
}

pub async fn update(db: &Db, uuid: NetworkId, ch: Changes<'_>) -> StoreResult<Network> {
    let resolvers = ch.resolvers.map(resolvers_text).transpose()?;
    let name = ch.name;
    in_tx!(db, |tx| {
        sqlx::query(TAKE_WRITE_LOCK).execute(&mut *tx).await?;
        let n = sqlx::query(
            "UPDATE networks SET name = COALESCE($2, name), resolvers = COALESCE($3, resolvers), \
             mtu = COALESCE($4, mtu), public = COALESCE($5, public), \
             is_default = COALESCE($6, is_default), \
             description = CASE WHEN $7 = 1 THEN $8 ELSE description END WHERE uuid = $1",
        )
        .bind(uuid.to_string())
        .bind(name)
        .bind(&resolvers)
        .bind(ch.mtu.map(i64::from))
        .bind(ch.public.map(i64::from))
        .bind(ch.default.map(i64::from))
        .bind(i64::from(ch.description.is_some()))
        .bind(ch.description.flatten())
        .execute(&mut *tx)
        .await
        .map_err(|e| unique_as_conflict(e, name_taken(name.unwrap_or_default())))?
        .rows_affected();
        if n == 0 {
            return Err(StoreError::NotFound("network"));
        }
        if let Some(owners) = ch.owners {
            sqlx::query("DELETE FROM network_owners WHERE network_uuid = $1")
                .bind(uuid.to_string())
                .execute(&mut *tx)
                .await?;
            add_owners!(tx, uuid, owners);
        }
        Ok(())
    })?;
    get(db, uuid).await
}

/// Deletes a network no VM holds an address on.
pub async fn delete(db: &Db, uuid: NetworkId) -> StoreResult<()> {
    let n = in_tx!(db, |tx| {
        sqlx::query(TAKE_WRITE_LOCK).execute(&mut *tx).await?;
        // The row's own lock, which every creation granting an address on it takes: no
        // address can be handed out between the count and the delete.
        sqlx::query("UPDATE networks SET next_ip = next_ip WHERE uuid = $1")
            .bind(uuid.to_string())
            .execute(&mut *tx)
            .await?;
        let held: i64 =
            sqlx::query_scalar("SELECT COUNT(*) FROM network_ips WHERE network_uuid = $1")
                .bind(uuid.to_string())
                .fetch_one(&mut *tx)
                .await?;
        if held > 0 {
            return Err(StoreError::Conflict(format!(
                "{held} address(es) of this network are in use; destroy those VMs first"
            )));
        }
        Ok(sqlx::query("DELETE FROM networks WHERE uuid = $1")
            .bind(uuid.to_string())
            .execute(&mut *tx)
            .await?
            .rows_affected())
    })?;
    if n == 0 {
        return Err(StoreError::NotFound("network"));
    }
    Ok(())
}

/// The networks marked default that `owner` may use, oldest first (the first is the
/// primary NIC's); `any` says whether any network exists at all.
pub async fn defaults_for(db: &Db, owner: AccountId) -> StoreResult<(Vec<Network>, bool)> {
    let sql = format!(
        "SELECT {COLS} FROM networks WHERE is_default = 1 AND (public = 1 OR uuid IN \
         (SELECT network_uuid FROM network_owners WHERE account_uuid = $1)) \
         ORDER BY created_at, uuid"
    );
    let rows: Vec<NetworkRow> = on_read!(db, |c| sqlx::query_as(&sql)
        .bind(owner.to_string())
        .fetch_all(c)
        .await)?;
    let any = if rows.is_empty() {
        let n: i64 = on_read!(db, |c| sqlx::query_scalar("SELECT COUNT(*) FROM networks")
            .fetch_one(c)
            .await)?;
        n > 0
    } else {
        true
    };
    let items = with_owners(db, rows).await?;
    Ok((items, any))
}

/// The addresses of a network in use, ascending, a page of them; and how many are in
/// use in all.
pub async fn ips(
    db: &Db,
    network: NetworkId,
    limit: i64,
    offset: i64,
) -> StoreResult<(Vec<NetworkIp>, i64)> {
    let rows: Vec<(i64, String, String, String, i64)> = on_read!(db, |c| sqlx::query_as(
        "SELECT ip, mac, vm_uuid, owner_uuid, created_at FROM network_ips \
         WHERE network_uuid = $1 ORDER BY ip LIMIT $2 OFFSET $3"
    )
    .bind(network.to_string())
    .bind(limit)
    .bind(offset)
    .fetch_all(c)
    .await)?;
    let total: i64 = on_read!(db, |c| sqlx::query_scalar(
        "SELECT COUNT(*) FROM network_ips WHERE network_uuid = $1"
    )
    .bind(network.to_string())
    .fetch_one(c)
    .await)?;
    let items = rows
        .into_iter()
        .map(|(ip, mac, vm, owner, at)| {
            Ok(NetworkIp {
                ip: u32::try_from(ip)
                    .map(std::net::Ipv4Addr::from)
                    .map_err(|_| StoreError::Corrupt(format!("address {ip}")))?,
                mac,
                vm_uuid: parse_uuid(&vm, "vm")?,
                owner_uuid: parse_uuid(&owner, "account")?,
                created_at: to_time(at),
            })
        })
        .collect::<StoreResult<Vec<_>>>()?;
    Ok((items, total))
}
