//! VM creations, one or a burst of them in one transaction: what concurrent `POST /v1/vms`
//! calls cost the database. Each creation claims its devices, quota and room through
//! `store::reserve` and keeps its own outcome (created, lost a device, no room, over quota)
//! exactly as if it had run alone in the order given; only the statements are shared.
//! Those that win get their VM row and their provision job. A lone creation is a batch of
//! one: there is no other path.

use super::jobs::{JobTx, NewJob};
use super::reserve::addresses::{AddressTx, NicWant};
use super::reserve::{self, Claim, ReserveTx, Verdict};
use super::room::Allocation;
use super::sql::Sql;
use super::{Db, StoreResult, now_ms, to_time};
use crate::{bind_args, in_tx};
use passage_model::api::{Vm, VmState};
use passage_model::jobs::JobKind;
use passage_model::networks::Nic;
use passage_model::{AccountId, DevicePath, JobId, PackageId, ServerId, VmId};

/// A VM to create, with what it reserves and the provision job that will build it.
pub struct NewVm<'a> {
    pub uuid: VmId,
    pub alias: &'a str,
    pub owner: AccountId,
    pub package: Option<PackageId>,
    pub vcpus: u32,
    pub memory_mib: u64,
    pub server: Option<ServerId>,
    pub devices: &'a [DevicePath],
    /// Its provision job.
    pub job: JobId,
    /// The image its boot disk is made from.
    pub image: Option<passage_model::ImageId>,
    /// The addresses it asks for, the primary first.
    pub nics: &'a [NicWant],
    /// Its metadata for the guest, as a JSON object.
    pub metadata: &'a str,
    /// Its tags.
    pub tags: &'a passage_model::tags::Tags,
    /// The owner's keys it is given ([`super::vms::GivenKey`]s as a JSON array); `None`
    /// for the owner's keys at each start.
    pub keys: Option<&'a str>,
}

impl NewVm<'_> {
    fn claim(&self) -> Claim<'_> {
        Claim {
            vm: self.uuid,
            owner: self.owner,
            server: self.server,
            devices: self.devices,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
        }
    }

    fn job(&self) -> NewJob {
        NewJob {
            uuid: self.job,
            kind: JobKind::Provision,
            vm: Some(self.uuid),
            owner: Some(self.owner),
            payload: None,
        }
    }

    /// The view of the VM just written, without reading it back.
    fn view(&self, now: i64, nics: Vec<Nic>) -> Vm {
        Vm {
            primary_ip: nics.iter().find(|n| n.primary).map(|n| n.ip),
            nics,
            uuid: self.uuid,
            alias: self.alias.to_string(),
            owner_uuid: self.owner,
            server_uuid: self.server,
            package_uuid: self.package,
            state: VmState::Provisioning,
            vcpus: self.vcpus,
            memory_mib: self.memory_mib,
            assigned_devices: self.devices.to_vec(),
            job_uuid: Some(self.job),
            image_uuid: self.image,
            tags: self.tags.clone(),
            keys: self.keys.and_then(super::vms::listed_keys),
            metadata: serde_json::from_str(self.metadata).unwrap_or_default(),
            created_at: to_time(now),
            updated_at: to_time(now),
        }
    }

    fn tags_json(&self) -> StoreResult<String> {
        serde_json::to_string(self.tags).map_err(super::corrupt)
    }

    fn devices_json(&self) -> StoreResult<String> {
        let ids: Vec<String> = self.devices.iter().map(ToString::to_string).collect();
        serde_json::to_string(&ids).map_err(super::corrupt)
    }
}

/// VM rows, in a transaction beside their reservation and jobs.
trait VmRowsTx {
    fn insert_vms(
        &mut self,
        vms: &[(&NewVm<'_>, &[Nic])],
        now: i64,
    ) -> impl Future<Output = StoreResult<()>> + Send;
}

fn nics_json(nics: &[Nic]) -> StoreResult<String> {
    serde_json::to_string(nics).map_err(super::corrupt)
}

impl VmRowsTx for sqlx::Transaction<'_, sqlx::Sqlite> {
    async fn insert_vms(&mut self, vms: &[(&NewVm<'_>, &[Nic])], now: i64) -> StoreResult<()> {
        let mut q = Sql::default();
        let mut rows = Vec::with_capacity(vms.len());
        for (vm, nics) in vms {
            let devices = vm.devices_json()?;
            let nics = nics_json(nics)?;
            let server = vm.server.map(|s| s.to_string());
            let package = vm.package.map(|p| p.to_string());
            let image = vm.image.map(|i| i.to_string());
            let null_or = |q: &mut Sql, v: Option<String>| {
                q.arg(v.map_or(super::page::Arg::Null, super::page::Arg::Text))
            };
            let tags = vm.tags_json()?;
            let keys = vm.keys.map(str::to_string);
            rows.push(format!(
                "({}, {}, {}, {}, {}, '{}', {}, {}, {}, {}, {}, {}, {}, {}, {}, {}, {})",
                q.text(vm.uuid),
                q.text(vm.alias),
                q.text(vm.owner),
                null_or(&mut q, server),
                null_or(&mut q, package),
                VmState::Provisioning.as_str(),
                q.int(i64::from(vm.vcpus)),
                q.int(i64::try_from(vm.memory_mib).unwrap_or(i64::MAX)),
                q.text(devices),
                q.text(vm.job),
                q.int(now),
                q.int(now),
                null_or(&mut q, image),
                q.text(nics),
                q.text(vm.metadata),
                q.text(tags),
                null_or(&mut q, keys),
            ));
        }
        let sql = format!(
            "INSERT INTO vms (uuid, alias, owner_uuid, server_uuid, package_uuid, state, vcpus, \
             memory_mib, assigned_devices, job_uuid, created_at, updated_at, image_uuid, nics, \
             metadata, tags, ssh_keys) VALUES {}",
            rows.join(", ")
        );
        bind_args!(sqlx::query(&sql), &q.args)
            .execute(&mut **self)
            .await?;
        Ok(())
    }
}

/// The VM rows on Postgres, one statement over arrays whatever their count.
const PG_INSERT: &str = "INSERT INTO vms (uuid, alias, owner_uuid, server_uuid, package_uuid, \
     state, vcpus, memory_mib, assigned_devices, job_uuid, created_at, updated_at, image_uuid, \
     nics, metadata, tags, ssh_keys) \
     SELECT x.u, x.a, x.o, x.s, x.p, $2, x.c, x.m, x.d, x.j, $1, $1, x.i, x.n, x.md, x.t, x.k \
     FROM UNNEST($3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int8[], \
     $9::int8[], $10::text[], $11::text[], $12::text[], $13::text[], $14::text[], \
     $15::text[], $16::text[]) AS x(u, a, o, s, p, c, m, d, j, i, n, md, t, k)";

impl VmRowsTx for sqlx::Transaction<'_, sqlx::Postgres> {
    async fn insert_vms(&mut self, all: &[(&NewVm<'_>, &[Nic])], now: i64) -> StoreResult<()> {
        let vms: Vec<&NewVm<'_>> = all.iter().map(|(v, _)| *v).collect();
        let texts = |f: &dyn Fn(&NewVm<'_>) -> String| -> Vec<String> {
            vms.iter().map(|v| f(v)).collect()
        };
        let devices = vms
            .iter()
            .map(|v| v.devices_json())
            .collect::<StoreResult<Vec<_>>>()?;
        let nics = all
            .iter()
            .map(|(_, n)| nics_json(n))
            .collect::<StoreResult<Vec<_>>>()?;
        sqlx::query(PG_INSERT)
            .bind(now)
            .bind(VmState::Provisioning.as_str())
            .bind(texts(&|v| v.uuid.to_string()))
            .bind(texts(&|v| v.alias.to_string()))
            .bind(texts(&|v| v.owner.to_string()))
            .bind(
                vms.iter()
                    .map(|v| v.server.map(|s| s.to_string()))
                    .collect::<Vec<_>>(),
            )
            .bind(
                vms.iter()
                    .map(|v| v.package.map(|p| p.to_string()))
                    .collect::<Vec<_>>(),
            )
            .bind(vms.iter().map(|v| i64::from(v.vcpus)).collect::<Vec<_>>())
            .bind(
                vms.iter()
                    .map(|v| i64::try_from(v.memory_mib).unwrap_or(i64::MAX))
                    .collect::<Vec<_>>(),
            )
            .bind(devices)
            .bind(texts(&|v| v.job.to_string()))
            .bind(
                vms.iter()
                    .map(|v| v.image.map(|i| i.to_string()))
                    .collect::<Vec<_>>(),
            )
            .bind(nics)
            .bind(texts(&|v| v.metadata.to_string()))
            .bind(
                vms.iter()
                    .map(|v| v.tags_json())
                    .collect::<StoreResult<Vec<_>>>()?,
            )
            .bind(
                vms.iter()
                    .map(|v| v.keys.map(str::to_string))
                    .collect::<Vec<_>>(),
            )
            .execute(&mut **self)
            .await?;
        Ok(())
    }
}

/// Creations inside one transaction, on either backend.
trait CreateTx {
    fn create_many(
        &mut self,
        vms: &[NewVm<'_>],
        alloc: Allocation,
    ) -> impl Future<Output = StoreResult<Vec<StoreResult<Vm>>>> + Send;
}

macro_rules! impl_create_tx {
    ($db:ty) => {
        impl CreateTx for sqlx::Transaction<'_, $db> {
            async fn create_many(
                &mut self,
                vms: &[NewVm<'_>],
                alloc: Allocation,
            ) -> StoreResult<Vec<StoreResult<Vm>>> {
                // Addresses first: a VM the networks refuse claims nothing else.
                let wants: Vec<&[NicWant]> = vms.iter().map(|v| v.nics).collect();
                let grants = self.grant(&wants).await?;
                let eligible: Vec<usize> =
                    (0..vms.len()).filter(|i| grants.nics[*i].is_ok()).collect();
                let claims: Vec<Claim<'_>> = eligible.iter().map(|i| vms[*i].claim()).collect();
                let verdicts: Vec<Verdict> = self
                    .reserve(&claims, alloc, JobKind::Provision.as_str())
                    .await?;
                let mut outcome: Vec<Option<Verdict>> = vec![None; vms.len()];
                for (i, v) in eligible.iter().zip(verdicts) {
                    outcome[*i] = Some(v);
                }
                let no_nics: Vec<Nic> = Vec::new();
                let won: Vec<(&NewVm<'_>, &[Nic])> = vms
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| matches!(outcome[*i], Some(Ok(()))))
                    .map(|(i, vm)| {
                        let nics = grants.nics[i].as_deref().unwrap_or(&no_nics);
                        (vm, nics)
                    })
                    .collect();
                let now = now_ms();
                if !won.is_empty() {
                    self.insert_vms(&won, now).await?;
                    let held: Vec<(VmId, AccountId, &[Nic])> = won
                        .iter()
                        .map(|(vm, nics)| (vm.uuid, vm.owner, *nics))
                        .collect();
                    self.hold(&grants, &held).await?;
                    let jobs: Vec<NewJob> = won.iter().map(|(vm, _)| vm.job()).collect();
                    self.insert_jobs(&jobs).await?;
                }
                Ok(vms
                    .iter()
                    .zip(outcome)
                    .zip(grants.nics)
                    .map(|((vm, verdict), nics)| match (verdict, nics) {
                        (Some(Ok(())), Ok(nics)) => Ok(vm.view(now, nics)),
                        (Some(Err(r)), _) => Err(reserve::refused(r)),
                        (_, Err(e)) => Err(e),
                        (None, Ok(_)) => Err(super::StoreError::Corrupt(
                            "a creation with addresses got no verdict".into(),
                        )),
                    })
                    .collect())
            }
        }
    };
}

impl_create_tx!(sqlx::Sqlite);
impl_create_tx!(sqlx::Postgres);

/// Creates every VM of `vms` that can be created, each with its devices reserved, its
/// owner's quota charged, its room taken and its provision job written, all in one
/// transaction. Each gets its own answer, as it would have got alone in this order:
/// `Retry` for a device no longer free (or claimed by an earlier VM of the batch),
/// `NoRoom`, `Quota`. An `Err` of the whole call means nothing was written.
pub async fn create_many(
    db: &Db,
    vms: &[NewVm<'_>],
    alloc: Allocation,
) -> StoreResult<Vec<StoreResult<Vm>>> {
    if vms.is_empty() {
        return Ok(Vec::new());
    }
    in_tx!(db, |tx| tx.create_many(vms, alloc).await)
}

/// Creates one VM: a batch of one.
pub async fn create_one(db: &Db, vm: NewVm<'_>, alloc: Allocation) -> StoreResult<Vm> {
    let mut outcomes = create_many(db, std::slice::from_ref(&vm), alloc).await?;
    outcomes.pop().unwrap_or_else(|| {
        Err(super::StoreError::Corrupt(
            "no outcome for a creation".into(),
        ))
    })
}
