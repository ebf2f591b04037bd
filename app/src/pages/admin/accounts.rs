use crate::components::errors::{FieldError, FormStatus};
use crate::components::guard::{Audience, Guard};
use crate::components::list::{ListPage, use_query_param};
use crate::components::widgets::{Badge, CsrfField};
use crate::data::load;
use crate::fmt;
use crate::rpc::{CreateAccount, SetQuota, list_accounts};
use leptos::prelude::*;
use leptos_meta::Title;
use passage_model::api::Account;

#[component]
pub fn AccountsPage() -> impl IntoView {
    let create = ServerAction::<CreateAccount>::new();
    let quota = ServerAction::<SetQuota>::new();
    let get = use_query_param();
    let data = load(
        move || {
            (
                create.version().get(),
                quota.version().get(),
                get("offset").and_then(|o| o.parse::<u64>().ok()),
            )
        },
        |(_, _, offset)| list_accounts(offset),
    );
    let result = Signal::derive(move || create.value().get());
    let quota_result = Signal::derive(move || quota.value().get());
    view! {
        <Title text="Accounts · Passage"/>
        <Guard audience=Audience::Staff>
            <h1>"Accounts"</h1>
            <ListPage path="/admin/accounts" data=data cursor="offset" let:accounts>
                <AccountTable accounts=accounts quota=quota/>
            </ListPage>
            <FormStatus result=quota_result ok="Quota saved." with_fields=true/>
            <section class="card" aria-labelledby="acct-form-h">
                <h2 id="acct-form-h">"New account"</h2>
                <ActionForm action=create>
                    <CsrfField/>
                    <div class="field">
                        <label for="a-login">"Login"</label>
                        <input id="a-login" name="login" type="text" autocomplete="off" aria-describedby="login-error"/>
                        <FieldError result=result field="login"/>
                    </div>
                    <div class="field">
                        <label for="a-password">"Initial password"</label>
                        <input id="a-password" name="password" type="password" autocomplete="new-password" aria-describedby="password-error"/>
                        <FieldError result=result field="password"/>
                    </div>
                    <div class="field">
                        <label for="a-role">"Role"</label>
                        <select id="a-role" name="role">
                            <option value="tenant" selected>"tenant"</option>
                            <option value="reader">"reader (read-only operator)"</option>
                            <option value="operator">"operator"</option>
                        </select>
                        <FieldError result=result field="role"/>
                    </div>
                    <div class="field">
                        <label for="a-quota">"GPU quota (empty: no limit)"</label>
                        <input id="a-quota" name="gpu_quota" type="text" inputmode="numeric" aria-describedby="gpu_quota-error"/>
                        <FieldError result=result field="gpu_quota"/>
                    </div>
                    <FormStatus result=result ok="Account created."/>
                    <button type="submit">"Create account"</button>
                </ActionForm>
            </section>
        </Guard>
    }
}

/// Each account, with its GPU quota editable in place.
#[component]
fn AccountTable(accounts: Vec<Account>, quota: ServerAction<SetQuota>) -> impl IntoView {
    view! {
        <table data-testid="accounts">
            <thead>
                <tr>
                    <th scope="col">"Login"</th>
                    <th scope="col">"Role"</th>
                    <th scope="col">"GPU quota"</th>
                    <th scope="col">"Created"</th>
                </tr>
            </thead>
            <tbody>
                {accounts.into_iter().map(|a| {
                    let id = format!("quota-{}", a.uuid);
                    let login = a.login.clone();
                    let login2 = a.login.clone();
                    let for_login = format!("of {}", a.login);
                    view! {
                        <tr data-login=a.login.clone()>
                            <th scope="row">{login2}</th>
                            <td><Badge state=a.role.as_str()/></td>
                            <td>
                                <ActionForm action=quota>
                                    <CsrfField/>
                                    <input type="hidden" name="uuid" value=a.uuid.to_string()/>
                                    <label for=id.clone() class="sr-only">"GPU quota of " {login}</label>
                                    <input id=id name="gpu_quota" type="text" inputmode="numeric" size="5"
                                        placeholder="none" value=a.gpu_quota.map(|n| n.to_string()).unwrap_or_default()/>
                                    <button type="submit">"Set quota " <span class="sr-only">{for_login}</span></button>
                                </ActionForm>
                            </td>
                            <td>{fmt::time(&a.created_at)}</td>
                        </tr>
                    }
                }).collect_view()}
            </tbody>
        </table>
    }
}
