//! The chaos workload: seeded transactions on `tests/fixtures/chaos_schema.sql`
//! that keep the schema's invariants in every commit.
//!
//! The workload is the only writer, so it keeps a model of which accounts,
//! invoices and lines exist and where each child hangs; every transaction
//! is one round trip (`BEGIN; …; COMMIT`) with its values inlined, and it
//! ends by recomputing the totals and setting `rev` of every aggregate it
//! touched (so invariants hold whatever the model believes about amounts).
//! A change is one changed row, as PostgreSQL counts them.

use std::collections::{BTreeSet, HashMap};
use std::fmt::Write as _;
use std::hash::Hash;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use tokio_postgres::{Client, SimpleQueryMessage};

pub const REGIONS: [&str; 4] = ["AP", "EU", "SA", "US"];
pub const SERIES: [&str; 3] = ["A", "B", "C"];

/// An account's key: (index into [`REGIONS`], acct_no).
pub type AKey = (usize, i32);
/// An invoice's key: (index into [`SERIES`], invoice_no).
pub type IKey = (usize, i32);

/// The subject of an account's events.
pub fn account_subject(k: AKey) -> String {
    format!("account.{},{}", REGIONS[k.0], k.1)
}

/// The subject of an invoice's events.
pub fn invoice_subject(k: IKey) -> String {
    format!("invoice.{},{}", SERIES[k.0], k.1)
}

/// A map that can also pick a random entry in O(1).
struct Indexed<K, V> {
    keys: Vec<K>,
    map: HashMap<K, (usize, V)>,
}

impl<K: Copy + Eq + Hash, V> Indexed<K, V> {
    fn new() -> Self {
        Indexed {
            keys: vec![],
            map: HashMap::new(),
        }
    }
    fn len(&self) -> usize {
        self.keys.len()
    }
    fn contains(&self, k: &K) -> bool {
        self.map.contains_key(k)
    }
    fn get(&self, k: &K) -> Option<&V> {
        self.map.get(k).map(|(_, v)| v)
    }
    fn get_mut(&mut self, k: &K) -> Option<&mut V> {
        self.map.get_mut(k).map(|(_, v)| v)
    }
    fn insert(&mut self, k: K, v: V) {
        assert!(!self.map.contains_key(&k), "model: key inserted twice");
        self.map.insert(k, (self.keys.len(), v));
        self.keys.push(k);
    }
    fn remove(&mut self, k: &K) -> V {
        let (i, v) = self.map.remove(k).expect("model: removing a missing key");
        self.keys.swap_remove(i);
        if let Some(moved) = self.keys.get(i) {
            self.map.get_mut(moved).unwrap().0 = i;
        }
        v
    }
    fn pick(&self, rng: &mut StdRng) -> Option<K> {
        (!self.keys.is_empty()).then(|| self.keys[rng.gen_range(0..self.keys.len())])
    }
}

struct Account {
    invoices: Vec<IKey>,
}

struct Invoice {
    account: AKey,
    lines: Vec<i32>,
    next_line: i32,
}

/// What the workload did, for the checker and the report.
#[derive(Default)]
pub struct Played {
    /// Changed rows, as PostgreSQL reported them.
    pub changes: u64,
    /// Committed transactions.
    pub txs: u64,
    /// Rows changed by the one large transaction.
    pub big_tx_rows: u64,
    /// Of `changes` and `txs`: those of the hot writer.
    pub hot_changes: u64,
    pub hot_txs: u64,
    /// Every `rev` the workload gave each aggregate (by subject), in order:
    /// the states that existed.
    pub history: HashMap<String, Vec<i64>>,
    /// Wall time of the workload.
    pub elapsed: Duration,
}

/// Sizes of a workload.
#[derive(Clone, Debug)]
pub struct Plan {
    pub seed: u64,
    /// Stop once at least this many rows changed.
    pub changes: u64,
    /// Account keys to draw from (the key space; created as the run goes).
    pub aggregates: u64,
    /// Rows of the one large transaction (played at half-way); 0: none.
    pub big_tx: u64,
    /// Spread the workload over at least this long (zero: full speed).
    pub duration: Duration,
    /// The hot writer's pause between its transactions (zero: no hot
    /// writer); see [`play_hot`].
    pub hot_every: Duration,
}

/// The model and the transaction being built.
struct Workload {
    rng: StdRng,
    accounts: Indexed<AKey, Account>,
    invoices: Indexed<IKey, Invoice>,
    per_region: i32,
    /// Added to every account number drawn (the hot writer's are apart).
    acct_base: i32,
    next_invoice: i32,
    /// This transaction's number: the `rev` it gives what it touches.
    rev: i64,
    sql: String,
    touched_accounts: BTreeSet<AKey>,
    touched_invoices: BTreeSet<IKey>,
}

fn amount(rng: &mut StdRng) -> String {
    format!("{}.{:02}", rng.gen_range(0..10_000), rng.gen_range(0..100))
}

fn word(rng: &mut StdRng) -> String {
    format!("{:08x}", rng.gen::<u32>())
}

impl Workload {
    fn new(plan: &Plan) -> Workload {
        Workload {
            rng: StdRng::seed_from_u64(plan.seed),
            accounts: Indexed::new(),
            invoices: Indexed::new(),
            per_region: (plan.aggregates.div_ceil(REGIONS.len() as u64)).max(1) as i32,
            acct_base: 0,
            next_invoice: 1,
            rev: 0,
            sql: String::new(),
            touched_accounts: BTreeSet::new(),
            touched_invoices: BTreeSet::new(),
        }
    }

    fn acct_where(k: AKey) -> String {
        format!("region = '{}' AND acct_no = {}", REGIONS[k.0], k.1)
    }

    fn inv_where(k: IKey) -> String {
        format!("series = '{}' AND invoice_no = {}", SERIES[k.0], k.1)
    }

    fn free_account_key(&mut self) -> Option<AKey> {
        (0..4).find_map(|_| {
            let k = (
                self.rng.gen_range(0..REGIONS.len()),
                self.acct_base + self.rng.gen_range(1..=self.per_region),
            );
            (!self.accounts.contains(&k)).then_some(k)
        })
    }

    fn new_invoice_key(&mut self) -> IKey {
        self.next_invoice += 1;
        (self.rng.gen_range(0..SERIES.len()), self.next_invoice)
    }

    /// Appends lines to invoice `i` (in the model and the SQL).
    fn insert_lines(&mut self, i: IKey, n: usize) {
        if n == 0 {
            return;
        }
        let mut values = vec![];
        for _ in 0..n {
            let inv = self.invoices.get_mut(&i).unwrap();
            let no = inv.next_line;
            inv.next_line += 1;
            inv.lines.push(no);
            values.push(format!(
                "('{}', {}, {no}, '{}', {})",
                SERIES[i.0],
                i.1,
                word(&mut self.rng),
                amount(&mut self.rng)
            ));
        }
        writeln!(
            self.sql,
            "INSERT INTO invoice_line (series, invoice_no, line_no, sku, amount) VALUES {};",
            values.join(", ")
        )
        .unwrap();
        self.touch_invoice(i);
    }

    fn insert_invoice(&mut self, a: AKey, lines: usize) -> IKey {
        let i = self.new_invoice_key();
        writeln!(
            self.sql,
            "INSERT INTO invoice (series, invoice_no, region, acct_no, memo, rev) VALUES ('{}', {}, '{}', {}, '{}', {});",
            SERIES[i.0], i.1, REGIONS[a.0], a.1, word(&mut self.rng), self.rev
        )
        .unwrap();
        self.invoices.insert(
            i,
            Invoice {
                account: a,
                lines: vec![],
                next_line: 1,
            },
        );
        self.accounts.get_mut(&a).unwrap().invoices.push(i);
        self.insert_lines(i, lines);
        self.touch_invoice(i);
        i
    }

    /// An invoice and, through it, its account.
    fn touch_invoice(&mut self, i: IKey) {
        self.touched_invoices.insert(i);
        let a = self.invoices.get(&i).unwrap().account;
        self.touched_accounts.insert(a);
    }

    fn create_account(&mut self) {
        let Some(a) = self.free_account_key() else {
            return self.rename_account();
        };
        writeln!(
            self.sql,
            "INSERT INTO account (region, acct_no, name, rev) VALUES ('{}', {}, '{}', {});",
            REGIONS[a.0],
            a.1,
            word(&mut self.rng),
            self.rev
        )
        .unwrap();
        self.accounts.insert(a, Account { invoices: vec![] });
        self.touched_accounts.insert(a);
        for _ in 0..self.rng.gen_range(0..=3) {
            let n = self.rng.gen_range(1..=4);
            self.insert_invoice(a, n);
        }
    }

    fn rename_account(&mut self) {
        let Some(a) = self.accounts.pick(&mut self.rng) else {
            return;
        };
        let status = ["open", "hold", "closed"][self.rng.gen_range(0..3)];
        writeln!(
            self.sql,
            "UPDATE account SET name = '{}', status = '{status}' WHERE {};",
            word(&mut self.rng),
            Self::acct_where(a)
        )
        .unwrap();
        self.touched_accounts.insert(a);
    }

    /// A change to a column left out of the etag only: publishes nothing.
    fn bump_row_version(&mut self) {
        let Some(a) = self.accounts.pick(&mut self.rng) else {
            return;
        };
        writeln!(
            self.sql,
            "UPDATE account SET row_version = row_version + 1 WHERE {};",
            Self::acct_where(a)
        )
        .unwrap();
    }

    fn add_invoice(&mut self) {
        let Some(a) = self.accounts.pick(&mut self.rng) else {
            return;
        };
        let n = self.rng.gen_range(0..=3);
        self.insert_invoice(a, n);
    }

    fn add_lines(&mut self) {
        let Some(i) = self.invoices.pick(&mut self.rng) else {
            return;
        };
        let n = self.rng.gen_range(1..=3);
        self.insert_lines(i, n);
    }

    /// An invoice that has lines, if one is found quickly.
    fn invoice_with_lines(&mut self) -> Option<IKey> {
        (0..4).find_map(|_| {
            self.invoices
                .pick(&mut self.rng)
                .filter(|i| !self.invoices.get(i).unwrap().lines.is_empty())
        })
    }

    fn update_lines(&mut self) {
        let Some(i) = self.invoice_with_lines() else {
            return;
        };
        let lines = self.invoices.get(&i).unwrap().lines.clone();
        for no in lines.choose_multiple(&mut self.rng, 2) {
            writeln!(
                self.sql,
                "UPDATE invoice_line SET amount = {} WHERE {} AND line_no = {no};",
                amount(&mut self.rng),
                Self::inv_where(i)
            )
            .unwrap();
        }
        self.touch_invoice(i);
    }

    fn delete_line(&mut self) {
        let Some(i) = self.invoice_with_lines() else {
            return;
        };
        let inv = self.invoices.get_mut(&i).unwrap();
        let at = self.rng.gen_range(0..inv.lines.len());
        let no = inv.lines.swap_remove(at);
        writeln!(
            self.sql,
            "DELETE FROM invoice_line WHERE {} AND line_no = {no};",
            Self::inv_where(i)
        )
        .unwrap();
        self.touch_invoice(i);
    }

    /// A grandchild moved to another invoice (often of another account).
    fn move_line(&mut self) {
        let (Some(from), Some(to)) = (self.invoice_with_lines(), self.invoices.pick(&mut self.rng))
        else {
            return;
        };
        if from == to {
            return;
        }
        self.touch_invoice(from);
        let src = self.invoices.get_mut(&from).unwrap();
        let at = self.rng.gen_range(0..src.lines.len());
        let no = src.lines.swap_remove(at);
        let dst = self.invoices.get_mut(&to).unwrap();
        let new_no = dst.next_line;
        dst.next_line += 1;
        dst.lines.push(new_no);
        writeln!(
            self.sql,
            "UPDATE invoice_line SET series = '{}', invoice_no = {}, line_no = {new_no} WHERE {} AND line_no = {no};",
            SERIES[to.0],
            to.1,
            Self::inv_where(from)
        )
        .unwrap();
        self.touch_invoice(to);
    }

    /// A child moved to another root.
    fn move_invoice(&mut self) {
        let (Some(i), Some(to)) = (
            self.invoices.pick(&mut self.rng),
            self.accounts.pick(&mut self.rng),
        ) else {
            return;
        };
        let from = self.invoices.get(&i).unwrap().account;
        if from == to {
            return;
        }
        self.touched_accounts.insert(from);
        let a = self.accounts.get_mut(&from).unwrap();
        a.invoices.retain(|x| *x != i);
        self.accounts.get_mut(&to).unwrap().invoices.push(i);
        self.invoices.get_mut(&i).unwrap().account = to;
        writeln!(
            self.sql,
            "UPDATE invoice SET region = '{}', acct_no = {} WHERE {};",
            REGIONS[to.0],
            to.1,
            Self::inv_where(i)
        )
        .unwrap();
        self.touch_invoice(i);
    }

    /// A root key update of an invoice (its lines follow it).
    fn rekey_invoice(&mut self) {
        let Some(old) = self.invoices.pick(&mut self.rng) else {
            return;
        };
        let new = self.new_invoice_key();
        writeln!(
            self.sql,
            "UPDATE invoice SET series = '{}', invoice_no = {} WHERE {};",
            SERIES[new.0],
            new.1,
            Self::inv_where(old)
        )
        .unwrap();
        writeln!(
            self.sql,
            "UPDATE invoice_line SET series = '{}', invoice_no = {} WHERE {};",
            SERIES[new.0],
            new.1,
            Self::inv_where(old)
        )
        .unwrap();
        self.touched_invoices.remove(&old);
        let inv = self.invoices.remove(&old);
        let a = self.accounts.get_mut(&inv.account).unwrap();
        for x in a.invoices.iter_mut().filter(|x| **x == old) {
            *x = new;
        }
        self.invoices.insert(new, inv);
        self.touch_invoice(new);
    }

    /// A root key update of an account (its invoices follow it).
    fn rekey_account(&mut self) {
        let (Some(old), Some(new)) = (self.accounts.pick(&mut self.rng), self.free_account_key())
        else {
            return;
        };
        writeln!(
            self.sql,
            "UPDATE account SET region = '{}', acct_no = {} WHERE {};",
            REGIONS[new.0],
            new.1,
            Self::acct_where(old)
        )
        .unwrap();
        let acct = self.accounts.remove(&old);
        if !acct.invoices.is_empty() {
            writeln!(
                self.sql,
                "UPDATE invoice SET region = '{}', acct_no = {} WHERE {};",
                REGIONS[new.0],
                new.1,
                Self::acct_where(old)
            )
            .unwrap();
        }
        self.touched_accounts.remove(&old);
        let invoices = acct.invoices.clone();
        self.accounts.insert(new, acct);
        self.touched_accounts.insert(new);
        for i in invoices {
            self.invoices.get_mut(&i).unwrap().account = new;
            self.touch_invoice(i);
        }
    }

    fn toggle_account_deleted(&mut self) {
        let Some(a) = self.accounts.pick(&mut self.rng) else {
            return;
        };
        writeln!(
            self.sql,
            "UPDATE account SET is_deleted = NOT is_deleted WHERE {};",
            Self::acct_where(a)
        )
        .unwrap();
        self.touched_accounts.insert(a);
    }

    fn toggle_invoice_deleted(&mut self) {
        let Some(i) = self.invoices.pick(&mut self.rng) else {
            return;
        };
        writeln!(
            self.sql,
            "UPDATE invoice SET is_deleted = NOT is_deleted WHERE {};",
            Self::inv_where(i)
        )
        .unwrap();
        self.touch_invoice(i);
    }

    fn delete_invoice(&mut self) {
        let Some(i) = self.invoices.pick(&mut self.rng) else {
            return;
        };
        self.touch_invoice(i);
        self.touched_invoices.remove(&i);
        let inv = self.invoices.remove(&i);
        self.accounts
            .get_mut(&inv.account)
            .unwrap()
            .invoices
            .retain(|x| *x != i);
        writeln!(
            self.sql,
            "DELETE FROM invoice_line WHERE {w}; DELETE FROM invoice WHERE {w};",
            w = Self::inv_where(i)
        )
        .unwrap();
    }

    fn delete_account(&mut self) {
        let Some(a) = self.accounts.pick(&mut self.rng) else {
            return;
        };
        let acct = self.accounts.remove(&a);
        self.touched_accounts.remove(&a);
        for i in &acct.invoices {
            self.invoices.remove(i);
            self.touched_invoices.remove(i);
        }
        writeln!(
            self.sql,
            "DELETE FROM invoice_line l USING invoice i WHERE l.series = i.series AND l.invoice_no = i.invoice_no AND i.{w};
             DELETE FROM invoice WHERE {w}; DELETE FROM account WHERE {w};",
            w = Self::acct_where(a)
        )
        .unwrap();
    }

    /// One random operation of a transaction.
    fn operation(&mut self) {
        // Without aggregates there is little else to do.
        if self.accounts.len() < 4 {
            return self.create_account();
        }
        match self.rng.gen_range(0..100) {
            0..=29 => self.create_account(),
            30..=35 => self.rename_account(),
            36..=38 => self.bump_row_version(),
            39..=45 => self.add_invoice(),
            46..=56 => self.add_lines(),
            57..=65 => self.update_lines(),
            66..=70 => self.delete_line(),
            71..=75 => self.move_line(),
            76..=80 => self.move_invoice(),
            81..=83 => self.rekey_invoice(),
            84..=86 => self.rekey_account(),
            87..=90 => self.toggle_account_deleted(),
            91..=93 => self.toggle_invoice_deleted(),
            94..=96 => self.delete_invoice(),
            _ => self.delete_account(),
        }
    }

    /// The large transaction: every line of many accounts repriced, then
    /// new accounts until it holds about `rows` changed rows.
    fn big_transaction(&mut self, rows: u64) {
        let mut invoices: Vec<IKey> = vec![];
        let mut lines = 0u64;
        let mut accounts = self.accounts.keys.clone();
        accounts.shuffle(&mut self.rng);
        let mut n_accounts = 0u64;
        for a in accounts {
            if lines + invoices.len() as u64 + n_accounts >= rows / 2 {
                break;
            }
            n_accounts += 1;
            for i in self.accounts.get(&a).unwrap().invoices.clone() {
                lines += self.invoices.get(&i).unwrap().lines.len() as u64;
                invoices.push(i);
            }
        }
        if !invoices.is_empty() {
            let list: Vec<String> = invoices
                .iter()
                .map(|i| format!("('{}', {})", SERIES[i.0], i.1))
                .collect();
            writeln!(
                self.sql,
                "UPDATE invoice_line SET amount = amount + 0.01 WHERE (series, invoice_no) IN ({});",
                list.join(", ")
            )
            .unwrap();
            for i in invoices {
                self.touch_invoice(i);
            }
        }
        let mut so_far = lines + self.touched_invoices.len() as u64 + n_accounts;
        while so_far < rows {
            let Some(a) = self.free_account_key() else {
                break;
            };
            writeln!(
                self.sql,
                "INSERT INTO account (region, acct_no, name, rev) VALUES ('{}', {}, 'bulk', {});",
                REGIONS[a.0], a.1, self.rev
            )
            .unwrap();
            self.accounts.insert(a, Account { invoices: vec![] });
            self.touched_accounts.insert(a);
            for _ in 0..2 {
                self.insert_invoice(a, 5);
            }
            // account + 2 invoices + 10 lines, and the recompute of each
            // account and invoice.
            so_far += 16;
        }
    }

    /// Ends the transaction: recomputes the totals of everything touched
    /// and gives it this transaction's `rev`.
    fn finish(&mut self, history: &mut HashMap<String, Vec<i64>>) -> String {
        let invoices: Vec<IKey> = std::mem::take(&mut self.touched_invoices)
            .into_iter()
            .filter(|i| self.invoices.contains(i))
            .collect();
        let accounts: Vec<AKey> = std::mem::take(&mut self.touched_accounts)
            .into_iter()
            .filter(|a| self.accounts.contains(a))
            .collect();
        let rev = self.rev;
        let mut sql = std::mem::take(&mut self.sql);
        if !invoices.is_empty() {
            let values: Vec<String> = invoices
                .iter()
                .map(|i| format!("('{}', {})", SERIES[i.0], i.1))
                .collect();
            writeln!(
                sql,
                "UPDATE invoice i SET rev = {rev}, total = s.total, line_count = s.n
                 FROM (SELECT v.series, v.invoice_no, coalesce(sum(l.amount), 0) AS total, count(l.line_no)::int AS n
                       FROM (VALUES {}) AS v (series, invoice_no)
                       LEFT JOIN invoice_line l ON l.series = v.series AND l.invoice_no = v.invoice_no
                       GROUP BY v.series, v.invoice_no) s
                 WHERE i.series = s.series AND i.invoice_no = s.invoice_no;",
                values.join(", ")
            )
            .unwrap();
        }
        if !accounts.is_empty() {
            let values: Vec<String> = accounts
                .iter()
                .map(|a| format!("('{}', {})", REGIONS[a.0], a.1))
                .collect();
            writeln!(
                sql,
                "UPDATE account a SET rev = {rev}, total = s.total, line_count = s.n, invoice_count = s.k
                 FROM (SELECT v.region, v.acct_no, coalesce(sum(i.total), 0) AS total,
                              coalesce(sum(i.line_count), 0)::int AS n, count(i.invoice_no)::int AS k
                       FROM (VALUES {}) AS v (region, acct_no)
                       LEFT JOIN invoice i ON i.region = v.region AND i.acct_no = v.acct_no
                       GROUP BY v.region, v.acct_no) s
                 WHERE a.region = s.region AND a.acct_no = s.acct_no;",
                values.join(", ")
            )
            .unwrap();
        }
        for i in invoices {
            history.entry(invoice_subject(i)).or_default().push(rev);
        }
        for a in accounts {
            history.entry(account_subject(a)).or_default().push(rev);
        }
        sql
    }
}

/// Key numbers of the hot writer's aggregates, far from the main workload's.
const HOT_BASE: i32 = 1_000_000_000;

/// The hot writer: on its own connection, until `stop`, small transactions
/// every `plan.hot_every` on a few aggregates of its own (repriced, added,
/// deleted and moved lines; totals and `rev` kept as the main workload
/// keeps them). The main workload is paced and alone would rarely commit
/// while the applier reads an aggregate's tables; this one commits often
/// enough that a hydration not done in one snapshot shows a torn state.
pub async fn play_hot(db: Client, plan: Plan, stop: Arc<AtomicBool>) -> Played {
    let mut w = Workload::new(&plan);
    w.rng = StdRng::seed_from_u64(plan.seed ^ 0x0005_eed0_f407);
    w.per_region = 1;
    w.acct_base = HOT_BASE;
    w.next_invoice = HOT_BASE;
    let mut out = Played::default();
    w.rev = 1;
    for _ in 0..3 {
        w.create_account();
    }
    for _ in 0..3 {
        w.add_invoice();
        w.add_lines();
    }
    let started = Instant::now();
    loop {
        let sql = w.finish(&mut out.history);
        if !sql.is_empty() {
            out.changes += commit(&db, &sql).await;
            out.txs += 1;
        }
        if stop.load(Ordering::Relaxed) {
            break;
        }
        tokio::time::sleep(plan.hot_every).await;
        w.rev += 1;
        match w.rng.gen_range(0..10) {
            0 => w.add_lines(),
            1 => w.delete_line(),
            2 => w.move_line(),
            _ => w.update_lines(),
        }
    }
    out.hot_changes = out.changes;
    out.hot_txs = out.txs;
    out.elapsed = started.elapsed();
    out
}

impl Played {
    /// Adds the hot writer's figures and history (its aggregates are its own).
    pub fn merge_hot(&mut self, hot: Played) {
        self.changes += hot.changes;
        self.txs += hot.txs;
        self.hot_changes += hot.hot_changes;
        self.hot_txs += hot.hot_txs;
        self.history.extend(hot.history);
    }
}

/// Runs `BEGIN; sql COMMIT;` as one round trip; returns the changed rows.
async fn commit(db: &Client, sql: &str) -> u64 {
    let msgs = db
        .simple_query(&format!("BEGIN;\n{sql}COMMIT;"))
        .await
        .unwrap_or_else(|e| panic!("workload transaction failed: {e}\n{sql}"));
    msgs.iter()
        .map(|m| match m {
            SimpleQueryMessage::CommandComplete(n) => *n,
            _ => 0,
        })
        .sum()
}

/// Plays the workload of `plan` against `db` until it changed at least
/// `plan.changes` rows.
pub async fn play(db: &Client, plan: &Plan) -> Played {
    let started = Instant::now();
    let mut w = Workload::new(plan);
    let mut out = Played::default();
    let mut big_done = plan.big_tx == 0;
    while out.changes < plan.changes {
        w.rev += 1;
        if !big_done && out.changes >= plan.changes / 2 {
            big_done = true;
            w.big_transaction(plan.big_tx);
            let sql = w.finish(&mut out.history);
            let n = commit(db, &sql).await;
            eprintln!("chaos workload: the large transaction changed {n} rows");
            out.big_tx_rows = n;
            out.changes += n;
            out.txs += 1;
            continue;
        }
        // Multi-statement transactions of 1 to 4 operations.
        for _ in 0..w.rng.gen_range(1..=4) {
            w.operation();
        }
        let sql = w.finish(&mut out.history);
        if sql.is_empty() {
            continue;
        }
        out.changes += commit(db, &sql).await;
        out.txs += 1;
        // Pace: no faster than the planned duration allows.
        if !plan.duration.is_zero() {
            let due = plan
                .duration
                .mul_f64(out.changes as f64 / plan.changes as f64);
            if let Some(wait) = due.checked_sub(started.elapsed()) {
                tokio::time::sleep(wait).await;
            }
        }
    }
    out.elapsed = started.elapsed();
    out
}
