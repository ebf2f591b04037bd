//! Networks: operators create and change them; tenants read the public ones and those
//! made for them (`owner_uuids`); another network does not exist for a tenant.

use super::Ctx;
use super::auth::Caller;
use crate::error::{ApiError, ApiResult};
use crate::store::networks::{self as store, Changes, NewNetwork};
use crate::store::reserve::addresses::NicWant;
use crate::store::{StoreError, accounts};
use passage_model::networks::{CreateNetwork, DEFAULT_MTU, Network, NetworkIp, UpdateNetwork};
use passage_model::{AccountId, NetworkId, ServerId};
use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

/// Every owner named exists.
async fn owners_exist(ctx: &Ctx, owners: &[passage_model::AccountId]) -> ApiResult<()> {
    for o in owners {
        match accounts::get(&ctx.db, *o).await {
            Ok(_) => {}
            Err(StoreError::NotFound(_)) => {
                return Err(ApiError::invalid("owner_uuids", format!("no account {o}")));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

pub async fn create(ctx: &Ctx, caller: &Caller, req: CreateNetwork) -> ApiResult<Network> {
    caller.require_operator()?;
    let (plan, resolvers) = req.validate()?;
    owners_exist(ctx, &req.owner_uuids).await?;
    let _forget = ForgetDefaults(ctx);
    Ok(store::insert(
        &ctx.db,
        NewNetwork {
            name: &req.name,
            plan,
            resolvers: &resolvers,
            vlan_id: req.vlan_id,
            bridge: &req.bridge,
            mtu: req.mtu.unwrap_or(DEFAULT_MTU),
            public: req.public,
            owners: &req.owner_uuids,
            default: req.default,
            description: req.description.as_deref().filter(|d| !d.is_empty()),
        },
    )
    .await?)
}

/// Clears the default networks' cache when dropped: after a network write, whether it
/// succeeded or not (a write that failed part-way may still have changed something), so
/// that this process's next creation reads what the write left.
struct ForgetDefaults<'a>(&'a Ctx);

impl Drop for ForgetDefaults<'_> {
    fn drop(&mut self) {
        self.0.default_networks.clear();
    }
}

fn visible(caller: &Caller, n: &Network) -> bool {
    caller.account.role.sees_all() || n.public || n.owner_uuids.contains(&caller.account.uuid)
}

pub async fn get(ctx: &Ctx, caller: &Caller, uuid: NetworkId) -> ApiResult<Network> {
    let n = store::get(&ctx.db, uuid).await?;
    if visible(caller, &n) {
        Ok(n)
    } else {
        Err(ApiError::not_found("network"))
    }
}

pub async fn list(
    ctx: &Ctx,
    caller: &Caller,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<Network>, i64)> {
    let who = (!caller.account.role.sees_all()).then_some(caller.account.uuid);
    Ok(store::list(&ctx.db, who, limit, offset).await?)
}

pub async fn update(
    ctx: &Ctx,
    caller: &Caller,
    uuid: NetworkId,
    req: UpdateNetwork,
) -> ApiResult<Network> {
    // A tenant learns nothing of a network it cannot see.
    get(ctx, caller, uuid).await?;
    caller.require_operator()?;
    let resolvers = req.validate()?;
    if let Some(o) = &req.owner_uuids {
        owners_exist(ctx, o).await?;
    }
    let _forget = ForgetDefaults(ctx);
    Ok(store::update(
        &ctx.db,
        uuid,
        Changes {
            name: req.name.as_deref(),
            resolvers: resolvers.as_deref(),
            mtu: req.mtu,
            public: req.public,
            owners: req.owner_uuids.as_deref(),
            default: req.default,
            description: req
                .description
                .as_deref()
                .map(|d| Some(d).filter(|d| !d.is_empty())),
        },
    )
    .await?)
}

pub async fn delete(ctx: &Ctx, caller: &Caller, uuid: NetworkId) -> ApiResult<()> {
    get(ctx, caller, uuid).await?;
    caller.require_operator()?;
    let _forget = ForgetDefaults(ctx);
    Ok(store::delete(&ctx.db, uuid).await?)
}

/// The addresses of a network in use, ascending, a page of them; operators only (an
/// address's holder is another tenant's business).
pub async fn ips(
    ctx: &Ctx,
    caller: &Caller,
    uuid: NetworkId,
    limit: i64,
    offset: i64,
) -> ApiResult<(Vec<NetworkIp>, i64)> {
    get(ctx, caller, uuid).await?;
    caller.require_operator()?;
    Ok(store::ips(&ctx.db, uuid, limit, offset).await?)
}

/// The default networks an owner may use, oldest first, and whether any network exists
/// (see `store::networks::defaults_for`).
pub type Defaults = Arc<(Vec<Network>, bool)>;

/// The cache key of the servers' bridges.
pub const BRIDGES_KEY: &str = "bridges";

pub type BridgeMap = Arc<HashMap<ServerId, BTreeSet<String>>>;

/// The servers a VM's networks allow: those with every bridge it needs.
#[derive(Clone)]
pub struct BridgeFilter {
    needs: BTreeSet<String>,
    map: Option<BridgeMap>,
}

impl BridgeFilter {
    /// Every server (a VM without networks).
    pub fn any() -> BridgeFilter {
        BridgeFilter {
            needs: BTreeSet::new(),
            map: None,
        }
    }

    pub async fn new(ctx: &Ctx, needs: BTreeSet<String>) -> ApiResult<BridgeFilter> {
        if needs.is_empty() {
            return Ok(BridgeFilter::any());
        }
        let map = ctx
            .bridges
            .get_or_load(BRIDGES_KEY, || async {
                crate::store::servers::bridges(&ctx.db).await.map(Arc::new)
            })
            .await?;
        Ok(BridgeFilter {
            needs,
            map: Some(map),
        })
    }

    pub fn admits(&self, server: ServerId) -> bool {
        match &self.map {
            None => true,
            Some(m) => m
                .get(&server)
                .is_some_and(|has| self.needs.iter().all(|b| has.contains(b))),
        }
    }

    pub fn needs(&self) -> &BTreeSet<String> {
        &self.needs
    }
}

/// What a new VM gets on networks: the NICs it asks for and the bridges they need.
pub struct Attachment {
    pub nics: Vec<NicWant>,
    pub bridges: BTreeSet<String>,
    /// The networks, in the NICs' order (for the node's spec and the guest's seed).
    pub networks: Vec<Network>,
}

/// The networks a new VM of `owner` asks for (`choices`, or the defaults), checked: each
/// one exists and `owner` may use it, and each fixed address is one it can give. Without
/// `choices` and without a default network the VM gets none when the installation has no
/// network at all, and is refused otherwise (an operator who made networks means VMs to
/// be on one).
pub async fn attach(
    ctx: &Ctx,
    caller: &Caller,
    owner: AccountId,
    choices: Option<&[passage_model::networks::NetworkChoice]>,
) -> ApiResult<Attachment> {
    let may_use = |n: &Network| {
        n.public
            || n.owner_uuids.contains(&owner)
            || (owner == caller.account.uuid && caller.account.role.sees_all())
    };
    let mut nics = Vec::new();
    let mut networks = Vec::new();
    match choices {
        Some(choices) => {
            let checked = passage_model::networks::check_choices("networks", choices)?;
            for (i, (key, fixed)) in checked.into_iter().enumerate() {
                let found = match key.parse::<NetworkId>() {
                    Ok(id) => store::get(&ctx.db, id).await,
                    Err(_) => store::by_name(&ctx.db, &key).await,
                };
                let n = match found {
                    Ok(n) if may_use(&n) => n,
                    Ok(_) | Err(StoreError::NotFound(_)) => {
                        return Err(ApiError::missing(
                            format!("networks[{i}]"),
                            format!("no network {key:?} that this VM's owner may use"),
                        ));
                    }
                    Err(e) => return Err(e.into()),
                };
                if networks.iter().any(|m: &Network| m.uuid == n.uuid) {
                    return Err(ApiError::invalid(
                        format!("networks[{i}]"),
                        "listed twice: a VM has one address on a network",
                    ));
                }
                if let Some(ip) = fixed {
                    let plan = passage_model::networks::AddressPlan::new(
                        &n.subnet,
                        n.gateway.map(|g| g.to_string()).as_deref(),
                        Some(&n.provision_start_ip.to_string()),
                        Some(&n.provision_end_ip.to_string()),
                    )?;
                    if !plan.fixable(ip) {
                        return Err(ApiError::invalid(
                            format!("networks[{i}].ipv4_ips[0]"),
                            format!(
                                "{ip} is not an address network {} can give: a host of {} \
                                 other than its gateway",
                                n.name, n.subnet
                            ),
                        ));
                    }
                }
                nics.push(NicWant {
                    network: n.uuid,
                    fixed,
                });
                networks.push(n);
            }
        }
        None => {
            let found = ctx
                .default_networks
                .get_or_load(&owner.to_string(), || async {
                    store::defaults_for(&ctx.db, owner).await.map(Arc::new)
                })
                .await?;
            let (defaults, any) = (&found.0, found.1);
            if defaults.is_empty() && any {
                return Err(ApiError::invalid(
                    "networks",
                    "no network is marked default for this VM's owner: name one \
                     (GET /v1/networks lists those it may use)",
                ));
            }
            for n in defaults
                .iter()
                .take(passage_model::protocol::MAX_NICS)
                .cloned()
            {
                nics.push(NicWant {
                    network: n.uuid,
                    fixed: None,
                });
                networks.push(n);
            }
        }
    }
    let bridges = networks.iter().map(|n| n.bridge.clone()).collect();
    Ok(Attachment {
        nics,
        bridges,
        networks,
    })
}
